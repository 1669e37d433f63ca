"""Llama-family decoder: SmolLM2/3, Llama 2/3, Mistral, Qwen2/3, Qwen3-MoE, OLMo 2, Phi-3, Gemma 2/3.

The model is purely per-token except for one call: ``attention(layer_idx, q, k, v)``,
supplied by the caller, which owns the KV cache. So the T tokens of one forward
may come from several sequences (a flattened batch) and the model never knows:

    input_ids [T] -> embed -> N x (norm -> qkv -> rotary -> attention() -> o_proj (+)
                                   norm -> gate_up -> silu*up -> down (+)) -> norm -> [T, hidden]

Each residual add (+) is done by the norm that follows it (``RMSNorm(x,
residual)``), so a layer takes and returns the pair (its input, the
residual stream before it). On the CPU, ``use_fused_ops`` moves the norms,
the rotary and silu*up into single C passes (``fused_ops``).

The families differ in a few building blocks, each chosen from a
``ModelConfig`` field (never from the architecture's name):

    qk_norm               q/k RMSNorm before rotary, per head (Qwen3) or whole (OLMo 2)
    norm_placement        "pre" (above), or "post": norms on the attention and
                          MLP outputs before each residual add (OLMo 2)
    no_rope_layers        layers that skip rotary (SmolLM3)
    partial_rotary_factor only the first values of each head rotate (Phi-3/4)
    num_experts           mixture-of-experts MLPs (Qwen3-MoE, see ``moe``)
    norm_placement        "sandwich": both, pre-norms and norms on the outputs (Gemma)
    norm_weight_offset    RMSNorm scales by 1 + weight (Gemma)
    mlp_activation        GeGLU instead of SwiGLU (Gemma)
    embedding_multiplier  embeddings scaled by sqrt(hidden_size) (Gemma)
    sliding_rope_theta    other rope tables for the sliding-window layers (Gemma 3)
    final_logit_softcapping  cap * tanh(logits / cap) on the LM head (Gemma 2)

What attention itself does per layer (its scale, soft-capping and window)
belongs to the ``attention`` callable, which reads it from the config.

Parameter names follow Hugging Face's except for two fusions, which
``load_weights`` undoes when it reads a checkpoint (unless the checkpoint
stores them fused too, as Phi-3's does):

    self_attn.qkv_proj  = rows of q_proj | k_proj | v_proj
    mlp.gate_up_proj    = rows of gate_proj | up_proj
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

import torch
import torch.nn.functional as F

from cadence.kernels import packed_weights
from cadence.models import quantized
from cadence.models.config import ModelConfig
from cadence.models.layers import Embedding, FusedLinear, GatedMLP, HeadRMSNorm, Linear, RMSNorm
from cadence.models.moe import Experts, SparseMoE
from cadence.models.quantized import Part, QuantizedTensor
from cadence.models.rotary import RotaryEmbedding, apply_rotary

if TYPE_CHECKING:
    from cadence.kernels.fused_ops import FusedOps
    from cadence.kernels.quant_matmul import QuantMatmul
    from cadence.models.step_buffer import StepBuffer

# attention(layer_idx, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
CosSin = tuple[torch.Tensor, torch.Tensor]  # rotary cos, sin: [T, 1, R] each (R = rotary_dim)

# Checkpoint entries that carry no weight of ours (old HF files saved these).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaAttention(torch.nn.Module):
    """q/k/v projection, q/k norm (if any), rotary, the caller's attention, output projection."""

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.uses_rope = layer_idx not in config.no_rope_layers
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shards = [("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)]
        self.qkv_proj = FusedLinear(config.hidden_size, shards, bias=config.attention_bias, dtype=dtype,
                                    checkpoint_fused=config.fused_checkpoint_projections)
        self.o_proj = Linear(q_size, config.hidden_size, bias=False, dtype=dtype)
        self.qk_norm = config.qk_norm
        if self.qk_norm is not None:
            per_head = self.qk_norm == "per_head"
            offset = config.norm_weight_offset
            self.q_norm = HeadRMSNorm(self.head_dim if per_head else q_size, config.rms_norm_eps, dtype=dtype,
                                      weight_offset=offset)
            self.k_norm = HeadRMSNorm(self.head_dim if per_head else kv_size, config.rms_norm_eps, dtype=dtype,
                                      weight_offset=offset)
        self.fused_ops: FusedOps | None = None  # see LlamaForCausalLM.use_fused_ops

    def forward(self, x: torch.Tensor, rope: CosSin, attention: AttentionFn) -> torch.Tensor:
        """``rope``: cos/sin [T, 1, R] in x's dtype, or float32 [T, D] with fused ops."""
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj.forward_split(x)  # [T, Hq*D], [T, Hkv*D], [T, Hkv*D]
        if self.qk_norm == "whole":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.uses_rope:
            q, k = self._rotate(q, k, rope)
        out = attention(self.layer_idx, q, k, v)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, rope: CosSin) -> tuple[torch.Tensor, torch.Tensor]:
        if rope[0].dim() == 2:  # float32 rows for the fused kernel (see LlamaModel._rope)
            self.fused_ops.rotary_(q, k, *rope)  # in place, in the projection's output
            return q, k
        return apply_rotary(q, *rope), apply_rotary(k, *rope)


def make_mlp(config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> torch.nn.Module:
    """Layer ``layer_idx``'s feed-forward: routed experts, or one gated MLP."""
    if config.is_moe_layer(layer_idx):
        return SparseMoE(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                         config.moe_intermediate_size, norm_topk_prob=config.norm_topk_prob, dtype=dtype)
    return GatedMLP(config.hidden_size, config.intermediate_size, dtype=dtype,
                    checkpoint_fused=config.fused_checkpoint_projections, activation=config.mlp_activation)


def make_norm(config: ModelConfig, dtype: torch.dtype) -> RMSNorm:
    """One hidden-size RMSNorm of the model."""
    return RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, weight_offset=config.norm_weight_offset)


class LlamaDecoderLayer(torch.nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x))`` then ``h + mlp(norm(h))``.

    Computed as ``(mlp_out, h) = layer(x_delta, residual)`` with x =
    residual + x_delta (no residual: the first layer, x itself); the caller
    adds the last pair.
    """

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = make_norm(config, dtype)
        self.self_attn = LlamaAttention(config, layer_idx, dtype)
        self.post_attention_layernorm = make_norm(config, dtype)
        self.mlp = make_mlp(config, layer_idx, dtype)

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


class PostNormDecoderLayer(torch.nn.Module):
    """OLMo 2's block: ``h = x + norm(attn(x))`` then ``h + norm(mlp(h))``.

    Same calling convention as ``LlamaDecoderLayer``: takes (x_delta,
    residual) and returns (mlp delta, h), the caller adding the last pair.
    """

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, dtype)
        self.post_attention_layernorm = make_norm(config, dtype)
        self.mlp = make_mlp(config, layer_idx, dtype)
        self.post_feedforward_layernorm = make_norm(config, dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: CosSin, attention: AttentionFn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = x if residual is None else residual + x
        hidden = hidden + self.post_attention_layernorm(self.self_attn(hidden, rope, attention))
        return self.post_feedforward_layernorm(self.mlp(hidden)), hidden


class SandwichDecoderLayer(torch.nn.Module):
    """Gemma's block: ``h = x + norm(attn(norm(x)))`` then ``h + norm(mlp(norm(h)))``.

    Same calling convention as ``LlamaDecoderLayer``: takes (x_delta,
    residual) and returns (mlp delta, h), the caller adding the last pair.
    """

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = make_norm(config, dtype)
        self.self_attn = LlamaAttention(config, layer_idx, dtype)
        self.post_attention_layernorm = make_norm(config, dtype)
        self.pre_feedforward_layernorm = make_norm(config, dtype)
        self.mlp = make_mlp(config, layer_idx, dtype)
        self.post_feedforward_layernorm = make_norm(config, dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: CosSin, attention: AttentionFn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            normed, residual = self.input_layernorm(x), x
        else:
            normed, residual = self.input_layernorm(x, residual)
        attn_out = self.post_attention_layernorm(self.self_attn(normed, rope, attention))
        normed, residual = self.pre_feedforward_layernorm(attn_out, residual)
        return self.post_feedforward_layernorm(self.mlp(normed)), residual


_DECODER_LAYERS = {"pre": LlamaDecoderLayer, "post": PostNormDecoderLayer, "sandwich": SandwichDecoderLayer}


class LlamaModel(torch.nn.Module):
    """Embedding, decoder layers and final norm (no LM head)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.embedding_multiplier = config.embedding_multiplier
        self.rotary = RotaryEmbedding(config)
        # Gemma 3's local layers turn with their own, unscaled tables.
        self.sliding_rotary = None if config.sliding_rope_theta is None else RotaryEmbedding(
            config.replace(rope_theta=config.sliding_rope_theta, rope_scaling=None))
        self.sliding_rope_layers = frozenset(i for i in range(config.num_hidden_layers)
                                             if config.uses_sliding_rope(i))
        # Partial rotary takes the fused kernel only where the kernel has it (not the GPU's).
        self.partial_rotary = config.rotary_dim != config.head_dim
        layer_class = _DECODER_LAYERS[config.norm_placement]
        self.layers = torch.nn.ModuleList(layer_class(config, i, dtype) for i in range(config.num_hidden_layers))
        self.norm = make_norm(config, dtype)
        self.fused_ops: FusedOps | None = None  # see LlamaForCausalLM.use_fused_ops

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        hidden = self.embed(input_ids)  # [T, hidden]
        # Looked up once, used by every layer.
        rope = self._rope(self.rotary, positions, hidden.dtype)
        sliding_rope = rope if self.sliding_rotary is None else self._rope(self.sliding_rotary, positions, hidden.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            layer_rope = sliding_rope if i in self.sliding_rope_layers else rope
            hidden, residual = layer(hidden, residual, layer_rope, attention)
        return self.norm(hidden, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings [T, hidden] (scaled where the model scales them)."""
        hidden = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            # In the hidden dtype, as the reference rounds it.
            hidden = hidden * torch.tensor(self.embedding_multiplier, dtype=hidden.dtype)
        return hidden

    def _rope(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> CosSin:
        ops = self.fused_ops
        if ops is not None and (not self.partial_rotary or "partial_rotary" in ops.OPERATIONS):
            return rotary.rows(positions)  # float32 [T, R] each
        return rotary(positions, dtype)  # [T, 1, R] each


class LlamaForCausalLM(torch.nn.Module):
    """The decoder plus its LM head; the caller owns the KV cache (see module doc)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, dtype)
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.tied_head_packed: torch.Tensor | None = None  # see pack_weights
        self.quant_kernel: QuantMatmul | None = None  # the tied head's, see use_quant_kernel
        # Where the head's product on GGUF blocks goes, step after step (the runner's, on the CPU).
        self.logits_buffer: StepBuffer | None = None
        # GGUF block types this model's loader dequantized for want of a kernel -> tensor count
        self.dequantized_at_load: dict[str, int] = {}

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights (and of the hidden states forward returns)."""
        return self.model.embed_tokens.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        """Hidden states [T, hidden] of tokens ``input_ids`` [T] at ``positions`` [T] (int64)."""
        return self.model(input_ids, positions, attention)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] of hidden states [N, hidden] (soft-capped where the model caps).
        With ``logits_buffer`` set they may be its rows, rewritten by the next call."""
        logits = self._head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden, self.logits_buffer)
        if self.tied_head_packed is not None:
            return packed_weights.packed_linear(hidden, self.tied_head_packed, None)
        table = self.model.embed_tokens.quantized
        if table is not None:
            return quantized.matmul(hidden, table, self.quant_kernel, self.logits_buffer)
        return F.linear(hidden, self.model.embed_tokens.weight)

    def use_fused_ops(self, ops: FusedOps | None) -> None:
        """Run norms, rotary and silu*up through ``ops`` (None: back to PyTorch's)."""
        for module in self.modules():
            if hasattr(module, "fused_ops"):
                module.fused_ops = ops

    def use_quant_kernel(self, kernel: QuantMatmul | None) -> None:
        """Run products on quantized weights through ``kernel`` (None: dequantize in PyTorch per call)."""
        for module in self.modules():
            if hasattr(module, "quant_kernel"):
                module.quant_kernel = kernel

    def limit_positions(self, num_positions: int) -> None:
        """Positions past ``num_positions`` are never asked for: the rotary
        tables shrink to it (before a runner reads them)."""
        for rotary in (self.model.rotary, self.model.sliding_rotary):
            if rotary is not None:
                rotary.limit_positions(num_positions)

    def quantized_weights(self) -> list[Part]:
        """Every part of a weight kept quantized (see ``quantized``): empty for a float model."""
        parts: list[Part] = []
        for module in self.modules():
            kept = getattr(module, "quantized", None)
            if isinstance(kept, QuantizedTensor):
                parts.append(kept)
            elif kept is not None:
                parts.extend(kept)
        return parts

    def pack_weights(self) -> int:
        """Pack every matmul weight for oneDNN (CPU; see ``packed_weights``).

        A tied LM head gets a packed copy: the embedding keeps its dense
        table for lookups. Returns how many matrices were packed (0 where
        this build or device cannot).
        """
        num_packed = sum(module.pack() for module in self.modules() if isinstance(module, Linear))
        embedding = self.model.embed_tokens.weight
        if self.lm_head is None and self.tied_head_packed is None and self.model.embed_tokens.quantized is None \
                and packed_weights.can_pack(embedding):
            self.tied_head_packed = packed_weights.pack(embedding)
            num_packed += 1
        return num_packed

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> None:
        """Copy in tensors named as in a Hugging Face checkpoint; fail if any is missing.

        ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj`` land in their
        rows of the fused projections. Tensors are cast to the model's dtype.
        A ``QuantizedTensor`` stays quantized where its layer can keep it (a
        ``Linear``, the embedding or the experts: ``keep_quantized``) and is dequantized elsewhere.
        """
        destinations = self.checkpoint_tensors()
        homes = self._quantized_homes()
        kept: dict[str, QuantizedTensor] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and self.lm_head is None):
                continue
            if name not in destinations:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            destination = destinations[name]
            if destination.shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(destination.shape)}")
            if isinstance(tensor, QuantizedTensor):
                if name in homes:
                    kept[name] = tensor
                    loaded.add(name)
                    continue
                tensor = tensor.dequantize()
            destination.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(destinations) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
        self._keep_quantized(kept, homes, destinations)

    def _quantized_homes(self) -> dict[str, tuple[torch.nn.Module, list[str]]]:
        """Checkpoint weight name -> (the layer that can keep it quantized, all its weight names in row order)."""
        homes = {}
        for path, module in self.named_modules():
            if not isinstance(module, (Linear, Embedding, Experts)):
                continue
            if hasattr(module, "checkpoint_tensors"):  # fused: one name per shard
                names = [name for name in module.checkpoint_tensors(path) if name.endswith(".weight")]
            else:
                names = [f"{path}.weight"]
            homes.update({name: (module, names) for name in names})
        return homes

    @staticmethod
    def _keep_quantized(kept: dict[str, QuantizedTensor], homes, destinations) -> None:
        """Hand each layer with a quantized shard its shards (float ones as loaded)."""
        done: set[int] = set()
        for name in kept:
            module, names = homes[name]
            if id(module) in done:
                continue
            done.add(id(module))
            shards: list[Part] = [kept[n] if n in kept else destinations[n].clone() for n in names]
            module.keep_quantized(shards)

    def checkpoint_names(self) -> list[str]:
        """Hugging Face names of every tensor ``load_weights`` needs."""
        return list(self.checkpoint_tensors())

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Each Hugging Face tensor name -> the part of our parameters it fills.

        Modules that store several checkpoint tensors in one parameter (fused
        projections, stacked experts) say which part is which; any other
        parameter is its own checkpoint tensor.
        """
        destinations: dict[str, torch.Tensor] = {}
        for path, module in self.named_modules():
            if hasattr(module, "checkpoint_tensors") and module is not self:
                destinations.update(module.checkpoint_tensors(path))
                continue
            prefix = f"{path}." if path else ""
            destinations.update({prefix + kind: param.data for kind, param in module.named_parameters(recurse=False)})
        return destinations

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


# Checkpoint projection name -> our fused projection holding its rows.
_SHARD_TO_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                   "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
