"""``ModelConfig``: the shape of a Llama-family decoder, whatever file it came from.

Two constructors read the two formats cadence loads: a Hugging Face
``config.json`` dict and GGUF metadata. Everything downstream (the model, the
KV-cache sizing in the runner) reads only this dataclass. Pure Python: no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from cadence.models.architectures import ARCHITECTURES, gguf_architecture, hf_architecture, hf_rope_scaling

# model_type (HF) -> the family name we store (GGUF names: ``architectures``).
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
QK_NORM_KINDS = ("per_head", "whole")  # RMSNorm over each head's D values, or over all of q (k)
# Norms before attention/MLP (Llama), on their outputs (OLMo 2), or both (Gemma's "sandwich").
NORM_PLACEMENTS = ("pre", "post", "sandwich")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")  # the gate's activation: SwiGLU, or GeGLU (tanh-approximated gelu)

# rope_type values the rotary embedding implements. "freq_factors" is what a
# GGUF carries for llama3 scaling: the converter stores precomputed per-frequency
# divisors (tensor ``rope_freqs.weight``) instead of the scaling parameters.
SUPPORTED_ROPE_TYPES = ("llama3", "linear", "freq_factors")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one Llama-family causal LM."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None, or a dict with "rope_type" in SUPPORTED_ROPE_TYPES and its parameters.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on the q/k/v projections (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    # q and k RMSNorm before rotary: None, or one of QK_NORM_KINDS.
    qk_norm: str | None = None
    norm_placement: str = "pre"  # one of NORM_PLACEMENTS
    no_rope_layers: tuple[int, ...] = ()  # indices of layers that apply no rotary (SmolLM3)
    partial_rotary_factor: float = 1.0  # share of each head rotated (the first rotary_dim values)
    # The checkpoint stores qkv_proj and gate_up_proj fused, as we compute them (Phi-3).
    fused_checkpoint_projections: bool = False
    # Mixture of experts: 0 experts means every MLP is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k router weights to sum to 1
    dense_mlp_layers: tuple[int, ...] = ()  # layers keeping a dense MLP in an MoE model
    mlp_activation: str = "silu"  # one of MLP_ACTIVATIONS
    # Every RMSNorm (q/k norms too) scales by (norm_weight_offset + weight): Gemma's 1 + weight.
    norm_weight_offset: float = 0.0
    embedding_multiplier: float = 1.0  # token embeddings are scaled by it (Gemma: sqrt(hidden_size))
    # q.k is scaled by query_pre_attn_scalar ** -0.5 (Gemma); None: head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # tanh soft-capping, cap * tanh(x / cap): of attention scores before softmax, of the LM head's logits.
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Layers that see the whole context although sliding_window is set (Gemma's global layers).
    full_attention_layers: tuple[int, ...] = ()
    # Rope base of the sliding-window layers, which then take no rope_scaling (Gemma 3's local
    # layers); None: every layer uses rope_theta and rope_scaling.
    sliding_rope_theta: float | None = None
    # How an embedding request pools the final hidden states ("last" or "mean"):
    # the GGUF's pooling_type where it names one of those, else None (last).
    pooling_type: str | None = None

    def __post_init__(self) -> None:
        _check(self.architecture in SUPPORTED_ARCHITECTURES, "architecture",
               f"{self.architecture!r} is not one of {SUPPORTED_ARCHITECTURES}")
        _check(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
               "must divide num_attention_heads")
        _check(self.head_dim % 2 == 0, "head_dim", "rotary embedding needs an even head_dim")
        _check(self.qk_norm in (None, *QK_NORM_KINDS), "qk_norm",
               f"{self.qk_norm!r} is not None or one of {QK_NORM_KINDS}")
        _check(self.norm_placement in NORM_PLACEMENTS, "norm_placement",
               f"{self.norm_placement!r} is not one of {NORM_PLACEMENTS}")
        _check(0 < self.partial_rotary_factor <= 1 and self.rotary_dim % 2 == 0, "partial_rotary_factor",
               f"{self.partial_rotary_factor} must be in (0, 1] and rotate an even number of values")
        _check(self.mlp_activation in MLP_ACTIVATIONS, "mlp_activation",
               f"{self.mlp_activation!r} is not one of {MLP_ACTIVATIONS}")
        _check(all(0 <= i < self.num_hidden_layers for i in self.full_attention_layers), "full_attention_layers",
               "must be layer indices")
        _check(self.num_experts == 0 or 0 < self.num_experts_per_tok <= self.num_experts,
               "num_experts_per_tok", "must be in [1, num_experts] for a mixture of experts")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            _check(rope_type in SUPPORTED_ROPE_TYPES, "rope_scaling",
                   f"rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` (already parsed)."""
        family = hf_architecture(hf.get("model_type", ""))
        num_heads = hf["num_attention_heads"]
        rope = _hf_rope_parameters(hf)
        common = dict(
            architecture=family.name,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rope_scaling=hf_rope_scaling(rope),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", False),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(hf.get("eos_token_id")),
            sliding_window=_hf_sliding_window(hf),
        )
        return cls(**{**common, **family.hf_fields(hf), **family.fixed})

    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, Any], *, tie_word_embeddings: bool
    ) -> ModelConfig:
        """Build from decoded GGUF key/values (``gguf_loader.read_metadata``).

        Whether the embeddings are tied is not in the metadata: a GGUF ties them
        by having no ``output.weight`` tensor, so the caller says.
        """
        arch = metadata["general.architecture"]
        family = gguf_architecture(arch)

        def key(name: str, default: Any = None) -> Any:
            return metadata.get(f"{arch}.{name}", default)

        hidden_size = key("embedding_length")
        num_heads = key("attention.head_count")
        head_dim = key("attention.key_length") or hidden_size // num_heads
        rope_dim = key("rope.dimension_count", head_dim)
        common = dict(
            architecture=family.name,
            vocab_size=key("vocab_size") or len(metadata["tokenizer.ggml.tokens"]),
            hidden_size=hidden_size,
            intermediate_size=key("feed_forward_length"),
            num_hidden_layers=key("block_count"),
            num_attention_heads=num_heads,
            num_key_value_heads=key("attention.head_count_kv") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope_scaling(key("rope.scaling.type"), key("rope.scaling.factor")),
            max_position_embeddings=key("context_length", 2048),
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=gguf_eos_token_ids(metadata),
            sliding_window=key("attention.sliding_window"),
            partial_rotary_factor=rope_dim / head_dim,
            pooling_type=GGUF_POOLING_TYPES.get(key("pooling_type")),
        )
        return cls(**{**common, **family.gguf_fields(key), **family.fixed})

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def rotary_dim(self) -> int:
        """How many of each head's head_dim values the rotary embedding rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` routes tokens to experts (else a dense MLP)."""
        return self.num_experts > 0 and layer_idx not in self.dense_mlp_layers

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The window layer ``layer_idx`` attends within (None: the whole context)."""
        return None if layer_idx in self.full_attention_layers else self.sliding_window

    def uses_sliding_rope(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` turns q/k with the ``sliding_rope_theta`` tables."""
        return self.sliding_rope_theta is not None and self.layer_sliding_window(layer_idx) is not None

    @property
    def attention_scale(self) -> float | None:
        """The q.k scale when it is not the usual head_dim ** -0.5 (None then)."""
        return None if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar ** -0.5

    @property
    def num_kv_groups(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    def kv_bytes_per_token(self, dtype: Any) -> int:
        """Bytes of K and V one token takes across all layers, for a cache of ``dtype``.

        ``dtype`` is anything with an ``itemsize`` (a torch or numpy dtype).
        """
        per_layer = 2 * self.num_key_value_heads * self.head_dim  # K and V
        return per_layer * self.num_hidden_layers * dtype.itemsize

    def num_params(self) -> int:
        """Number of weights in the model (tied embeddings counted once)."""
        h, d = self.hidden_size, self.head_dim
        q_size, kv_size = self.num_attention_heads * d, self.num_key_value_heads * d
        attention = h * (q_size + 2 * kv_size) + q_size * h
        if self.attention_bias:
            attention += q_size + 2 * kv_size
        attention += {None: 0, "per_head": 2 * d, "whole": q_size + kv_size}[self.qk_norm]
        dense_mlp = 3 * h * self.intermediate_size
        moe_mlp = self.num_experts * (3 * h * self.moe_intermediate_size + h)  # experts + router row
        mlps = sum(moe_mlp if self.is_moe_layer(i) else dense_mlp for i in range(self.num_hidden_layers))
        norms = 4 if self.norm_placement == "sandwich" else 2  # RMSNorm weights a layer
        layers = self.num_hidden_layers * (attention + norms * h) + mlps
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + layers + h  # + final norm


# llama.cpp's enum llama_pooling_type, for the kinds an embedding request can
# pool here (0 none, 2 cls and 4 rank are left to the default, last).
GGUF_POOLING_TYPES = {1: "mean", 3: "last"}


def gguf_eos_token_ids(metadata: Mapping[str, Any]) -> tuple[int, ...]:
    """End-of-sequence ids of a GGUF: eos plus end-of-turn/end-of-message when present."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ids = [metadata[k] for k in keys if metadata.get(k) is not None]
    return tuple(dict.fromkeys(ids))


def _check(condition: bool, name: str, message: str) -> None:
    if not condition:
        raise ValueError(f"ModelConfig.{name}: {message}")


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(value)


def _hf_rope_parameters(hf: Mapping[str, Any]) -> dict[str, Any]:
    """rope_theta and scaling, from either spelling of config.json.

    Older files have ``rope_theta`` + ``rope_scaling``; transformers 5 writes a
    single ``rope_parameters`` dict holding both.
    """
    params = dict(hf.get("rope_parameters") or {})
    params.update(hf.get("rope_scaling") or {})
    if "rope_theta" in hf:
        params["rope_theta"] = hf["rope_theta"]
    return params


def _hf_sliding_window(hf: Mapping[str, Any]) -> int | None:
    # Qwen2 configs carry a window but switch it off with use_sliding_window.
    if hf.get("use_sliding_window") is False:
        return None
    return hf.get("sliding_window")


def _gguf_rope_scaling(kind: str | None, factor: float | None) -> dict[str, Any] | None:
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    raise ValueError(f"GGUF rope scaling {kind!r} is not supported")
