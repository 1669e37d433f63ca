"""What each supported decoder family adds to the Llama shape, and where its files say it.

One ``Architecture`` per family: the fields every model of the family has
(``fixed``: Qwen3 always norms q and k per head), and two readers for the
fields a model's own file chooses (``hf_fields`` from config.json,
``gguf_fields`` from GGUF metadata). ``ModelConfig`` applies them; nothing
else branches on an architecture's name, except the GGUF loader's tensor
names. Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

# A GGUF metadata lookup without the "<arch>." prefix: key("expert_count", default).
GgufKey = Callable[..., Any]


def _none(_source: Any) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Architecture:
    """One decoder family: its names and the ``ModelConfig`` fields it sets."""

    name: str  # Hugging Face model_type; what ModelConfig.architecture holds
    gguf_name: str  # general.architecture of its GGUF files
    fixed: Mapping[str, Any] = field(default_factory=dict)
    hf_fields: Callable[[Mapping[str, Any]], dict[str, Any]] = _none
    gguf_fields: Callable[[GgufKey], dict[str, Any]] = _none
    # llama.cpp's converter reordered q/k rows for its interleaved rope
    # (see gguf_loader); families run with the rotate_half ("NEOX") rope were not.
    gguf_rope_permuted: bool = False
    # What llama.cpp's converter added to every RMSNorm weight (Gemma's
    # ``1 + weight`` folded in); the GGUF loader takes it off again.
    gguf_norm_shift: float = 0.0


def _smollm3_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    # HF's no_rope_layers is a per-layer mask, 1 where the layer *uses* rope.
    num_layers = hf["num_hidden_layers"]
    uses_rope = hf.get("no_rope_layers")
    if uses_rope is None:
        interval = hf.get("no_rope_layer_interval", 4)
        uses_rope = [(i + 1) % interval != 0 for i in range(num_layers)]
    return {"no_rope_layers": tuple(i for i, use in enumerate(uses_rope) if not use)}


def _smollm3_gguf(key: GgufKey) -> dict[str, Any]:
    # llama.cpp runs every n-th layer without rope (n = 4 unless the file says).
    interval = key("no_rope_layer_step", 4)
    return {"no_rope_layers": tuple(i for i in range(key("block_count")) if (i + 1) % interval == 0)}


def _qwen3_moe_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    step = hf.get("decoder_sparse_step", 1)
    dense_only = set(hf.get("mlp_only_layers") or ())
    return {
        # transformers 5 writes num_local_experts; older files num_experts.
        "num_experts": hf.get("num_local_experts") or hf["num_experts"],
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "norm_topk_prob": hf.get("norm_topk_prob", False),
        "dense_mlp_layers": tuple(i for i in range(hf["num_hidden_layers"])
                                  if i in dense_only or (i + 1) % step != 0),
    }


def _qwen3_moe_gguf(key: GgufKey) -> dict[str, Any]:
    return {
        "num_experts": key("expert_count"),
        "num_experts_per_tok": key("expert_used_count"),
        "moe_intermediate_size": key("expert_feed_forward_length"),
        # llama.cpp always renormalises Qwen3-MoE's top-k weights.
        "norm_topk_prob": bool(key("expert_weights_norm", True)),
    }


def _phi3_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    rope = hf.get("rope_parameters") or {}
    return {"partial_rotary_factor": float(hf.get("partial_rotary_factor")
                                           or rope.get("partial_rotary_factor") or 1.0)}


def hf_rope_scaling(rope: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``rope_scaling`` field from config.json's rope parameters (None for plain rope)."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "type")}
    scaling["rope_type"] = rope_type
    return scaling


# Gemma 2 and 3 share these; each has its own rope and attention extras below.
_GEMMA_FIXED = {"norm_placement": "sandwich", "norm_weight_offset": 1.0, "mlp_activation": "gelu_tanh"}


def _gemma_hf(hf: Mapping[str, Any], default_pattern: int) -> dict[str, Any]:
    """Fields common to Gemma 2 and 3 config.json files."""
    activation = hf.get("hidden_activation") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {activation!r} is not supported for Gemma (gelu_pytorch_tanh is)")
    num_layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if layer_types is None:
        pattern = hf.get("sliding_window_pattern", default_pattern)
        layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                       for i in range(num_layers)]
    return {
        "embedding_multiplier": hf["hidden_size"] ** 0.5,
        "query_pre_attn_scalar": float(hf["query_pre_attn_scalar"]),
        "attn_logit_softcapping": hf.get("attn_logit_softcapping"),
        "final_logit_softcapping": hf.get("final_logit_softcapping"),
        "full_attention_layers": tuple(i for i, kind in enumerate(layer_types) if kind == "full_attention"),
    }


def _gemma2_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    return _gemma_hf(hf, default_pattern=2)


def _gemma3_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    # transformers 5 writes one rope dict per layer type; older files
    # rope_theta (+ rope_scaling) for the global layers, rope_local_base_freq for the others.
    rope = hf.get("rope_parameters") or {}
    full = dict(rope.get("full_attention") or {})
    full.update(hf.get("rope_scaling") or {})
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    sliding = rope.get("sliding_attention") or {}
    if hf_rope_scaling(sliding) is not None:
        raise ValueError("rope scaling on Gemma 3's sliding-window layers is not supported")
    return {
        **_gemma_hf(hf, default_pattern=6),
        "rope_theta": float(full["rope_theta"]),
        "rope_scaling": hf_rope_scaling(full),
        "sliding_rope_theta": float(sliding.get("rope_theta", hf.get("rope_local_base_freq", 10000.0))),
    }


def _gemma_gguf(key: GgufKey, pattern: int, num_layers_27b: int) -> dict[str, Any]:
    # llama.cpp: every pattern-th layer is global, the others use the window
    # (unless the file says another pattern); it scales q by head_dim ** -0.5,
    # except in the 27B models, whose query_pre_attn_scalar is hidden / heads.
    num_layers, hidden, heads = key("block_count"), key("embedding_length"), key("attention.head_count")
    pattern = key("attention.sliding_window_pattern", pattern)
    scalar = hidden / heads if num_layers == num_layers_27b else key("attention.key_length") or hidden / heads
    return {
        "embedding_multiplier": hidden ** 0.5,
        "query_pre_attn_scalar": float(scalar),
        "attn_logit_softcapping": key("attn_logit_softcapping"),
        "final_logit_softcapping": key("final_logit_softcapping"),
        "full_attention_layers": tuple(i for i in range(num_layers) if (i + 1) % pattern == 0),
    }


def _gemma2_gguf(key: GgufKey) -> dict[str, Any]:
    return _gemma_gguf(key, pattern=2, num_layers_27b=46)


def _gemma3_gguf(key: GgufKey) -> dict[str, Any]:
    # The linear rope scaling in the file is the global layers'; the local ones run unscaled.
    return {**_gemma_gguf(key, pattern=6, num_layers_27b=62),
            "sliding_rope_theta": float(key("rope.freq_base_swa", 10000.0))}


_FAMILIES = (
    Architecture("llama", "llama", gguf_rope_permuted=True),
    Architecture("mistral", "mistral"),
    Architecture("qwen2", "qwen2", fixed={"attention_bias": True}),  # its config does not say so
    Architecture("qwen3", "qwen3", fixed={"qk_norm": "per_head"}),
    Architecture("olmo2", "olmo2", fixed={"qk_norm": "whole", "norm_placement": "post"}),
    Architecture("smollm3", "smollm3", hf_fields=_smollm3_hf, gguf_fields=_smollm3_gguf,
                 gguf_rope_permuted=True),
    Architecture("phi3", "phi3", fixed={"fused_checkpoint_projections": True}, hf_fields=_phi3_hf),
    Architecture("qwen3_moe", "qwen3moe", fixed={"qk_norm": "per_head"},
                 hf_fields=_qwen3_moe_hf, gguf_fields=_qwen3_moe_gguf),
    Architecture("gemma2", "gemma2", fixed=_GEMMA_FIXED, hf_fields=_gemma2_hf, gguf_fields=_gemma2_gguf,
                 gguf_norm_shift=1.0),
    Architecture("gemma3_text", "gemma3", fixed={**_GEMMA_FIXED, "qk_norm": "per_head"},
                 hf_fields=_gemma3_hf, gguf_fields=_gemma3_gguf, gguf_norm_shift=1.0),
)
ARCHITECTURES: dict[str, Architecture] = {family.name: family for family in _FAMILIES}
_BY_GGUF_NAME = {family.gguf_name: family for family in _FAMILIES}


def hf_architecture(model_type: str) -> Architecture:
    """The family of a config.json's ``model_type``; ValueError naming it and the supported ones."""
    family = ARCHITECTURES.get(model_type)
    if family is None:
        raise ValueError(f"model_type {model_type!r} is not supported "
                         f"(supported: {tuple(ARCHITECTURES)})")
    return family


def gguf_architecture(gguf_name: str) -> Architecture:
    """The family of a GGUF's ``general.architecture``; ValueError naming it and the supported ones."""
    family = _BY_GGUF_NAME.get(gguf_name)
    if family is None:
        raise ValueError(f"GGUF architecture {gguf_name!r} is not supported "
                         f"(supported: {tuple(_BY_GGUF_NAME)})")
    return family
