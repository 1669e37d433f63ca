"""Llama-family decoder: SmolLM2, Llama 2/3, Mistral, Qwen2/2.5.

The model is purely per-token except for one call: ``attention(layer_idx, q, k, v)``,
supplied by the caller, which owns the KV cache. So the T tokens of one forward
may come from several sequences (a flattened batch) and the model never knows:

    input_ids [T] -> embed -> N x (norm -> qkv -> rotary -> attention() -> o_proj (+)
                                   norm -> gate_up -> silu*up -> down (+)) -> norm -> [T, hidden]

Each residual add (+) is done by the norm that follows it (``RMSNorm(x,
residual)``), so a layer takes and returns the pair (its input, the
residual stream before it). On the CPU, ``use_fused_ops`` moves the norms,
the rotary and silu*up into single C passes (``fused_ops``).

Parameter names follow Hugging Face's except for two fusions, which
``load_weights`` undoes when it reads a checkpoint:

    self_attn.qkv_proj  = rows of q_proj | k_proj | v_proj
    mlp.gate_up_proj    = rows of gate_proj | up_proj
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

import torch
import torch.nn.functional as F

from cadence.models import packed_weights
from cadence.models.config import ModelConfig
from cadence.models.layers import Embedding, FusedLinear, GatedMLP, Linear, RMSNorm
from cadence.models.rotary import RotaryEmbedding, apply_rotary

if TYPE_CHECKING:
    from cadence.kernels.fused_ops import FusedOps

# attention(layer_idx, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
CosSin = tuple[torch.Tensor, torch.Tensor]  # rotary cos, sin: [T, 1, D] each

# Checkpoint entries that carry no weight of ours (old HF files saved these).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaAttention(torch.nn.Module):
    """q/k/v projection, rotary, the caller's attention, output projection."""

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shards = [("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)]
        self.qkv_proj = FusedLinear(config.hidden_size, shards, bias=config.attention_bias, dtype=dtype)
        self.o_proj = Linear(q_size, config.hidden_size, bias=False, dtype=dtype)
        self.fused_ops: FusedOps | None = None  # see LlamaForCausalLM.use_fused_ops

    def forward(self, x: torch.Tensor, rope: CosSin, attention: AttentionFn) -> torch.Tensor:
        """``rope``: cos/sin [T, 1, D] in x's dtype, or float32 [T, D] with fused ops."""
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj.forward_split(x)  # [T, Hq*D], [T, Hkv*D], [T, Hkv*D]
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.fused_ops is not None:
            self.fused_ops.rotary_(q, k, *rope)  # in place, in the projection's output
        else:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = attention(self.layer_idx, q, k, v)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaDecoderLayer(torch.nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x))`` then ``h + mlp(norm(h))``.

    Computed as ``(mlp_out, h) = layer(x_delta, residual)`` with x =
    residual + x_delta (no residual: the first layer, x itself); the caller
    adds the last pair.
    """

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.self_attn = LlamaAttention(config, layer_idx, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, dtype=dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: CosSin, attention: AttentionFn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            normed, residual = self.input_layernorm(x), x
        else:
            normed, residual = self.input_layernorm(x, residual)
        attn_out = self.self_attn(normed, rope, attention)
        normed, residual = self.post_attention_layernorm(attn_out, residual)
        return self.mlp(normed), residual


class LlamaModel(torch.nn.Module):
    """Embedding, decoder layers and final norm (no LM head)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.rotary = RotaryEmbedding(config)
        self.layers = torch.nn.ModuleList(
            LlamaDecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.fused_ops: FusedOps | None = None  # see LlamaForCausalLM.use_fused_ops

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        # Looked up once, used by every layer.
        if self.fused_ops is not None:
            rope = self.rotary.rows(positions)  # float32 [T, D] each
        else:
            rope = self.rotary(positions, hidden.dtype)  # [T, 1, D] each
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope, attention)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(torch.nn.Module):
    """The decoder plus its LM head; the caller owns the KV cache (see module doc)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, dtype)
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.tied_head_packed: torch.Tensor | None = None  # see pack_weights

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights (and of the hidden states forward returns)."""
        return self.model.embed_tokens.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        """Hidden states [T, hidden] of tokens ``input_ids`` [T] at ``positions`` [T] (int64)."""
        return self.model(input_ids, positions, attention)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] of hidden states [N, hidden]."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if self.tied_head_packed is not None:
            return packed_weights.packed_linear(hidden, self.tied_head_packed, None).float()
        return F.linear(hidden, self.model.embed_tokens.weight).float()

    def use_fused_ops(self, ops: FusedOps | None) -> None:
        """Run norms, rotary and silu*up through ``ops`` (None: back to PyTorch's)."""
        for module in self.modules():
            if hasattr(module, "fused_ops"):
                module.fused_ops = ops

    def pack_weights(self) -> int:
        """Pack every matmul weight for oneDNN (CPU; see ``packed_weights``).

        A tied LM head gets a packed copy: the embedding keeps its dense
        table for lookups. Returns how many matrices were packed (0 where
        this build or device cannot).
        """
        num_packed = sum(module.pack() for module in self.modules() if isinstance(module, Linear))
        embedding = self.model.embed_tokens.weight
        if self.lm_head is None and self.tied_head_packed is None and packed_weights.can_pack(embedding):
            self.tied_head_packed = packed_weights.pack(embedding)
            num_packed += 1
        return num_packed

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy in tensors named as in a Hugging Face checkpoint; fail if any is missing.

        ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj`` land in their
        rows of the fused projections. Tensors are cast to the model's dtype.
        """
        expected = set(self.checkpoint_names())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and self.lm_head is None):
                continue
            if name not in expected:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            destination = self._destination(name)
            if destination.shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(destination.shape)}")
            destination.copy_(tensor)
            loaded.add(name)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")

    def checkpoint_names(self) -> list[str]:
        """Hugging Face names of every tensor ``load_weights`` needs."""
        names = []
        for name, _ in self.named_parameters():
            module_path, _, kind = name.rpartition(".")
            module = self.get_submodule(module_path)
            shards = getattr(module, "shard_names", None) or (None,)
            names.extend(name if shard is None else f"{module_path.rpartition('.')[0]}.{shard}.{kind}"
                         for shard in shards)
        return names

    def projection(self, name: str) -> tuple[Linear, int]:
        """The layer computing Hugging Face projection ``name`` (e.g.
        ``model.layers.0.self_attn.k_proj``) and the shard of its output that
        holds it (0 for an unfused layer); ValueError when the model has none."""
        parent, _, leaf = name.rpartition(".")
        fused = _SHARD_TO_FUSED.get(leaf)
        try:
            module = self.get_submodule(f"{parent}.{fused}" if fused else name)
        except AttributeError:
            module = None
        if not isinstance(module, Linear):
            raise ValueError(f"the model has no linear layer {name!r}")
        return module, (module.shard_names.index(leaf) if fused else 0)

    def _destination(self, name: str) -> torch.Tensor:
        """The rows of our parameter that checkpoint tensor ``name`` fills."""
        parent, shard, kind = _split_param_name(name)
        fused = _SHARD_TO_FUSED.get(shard)
        if fused is None:
            return self.get_parameter(name).data
        module = self.get_submodule(f"{parent}.{fused}")
        index = module.shard_names.index(shard)
        start = sum(module.shard_sizes[:index])
        return getattr(module, kind).data.narrow(0, start, module.shard_sizes[index])


# Checkpoint projection name -> our fused projection holding its rows.
_SHARD_TO_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                   "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def _split_param_name(name: str) -> tuple[str, str, str]:
    """``model.layers.0.mlp.up_proj.weight`` -> (``model.layers.0.mlp``, ``up_proj``, ``weight``)."""
    rest, _, kind = name.rpartition(".")
    parent, _, module = rest.rpartition(".")
    return parent, module, kind
