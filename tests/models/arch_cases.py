"""Tiny random transformers models of each newer family, and GGUF files written from them.

    hf = random_hf_model("qwen3")               transformers' model, float32, eval
    hf.save_pretrained(folder)                  an HF folder cadence loads
    write_gguf(path, hf)                        the same weights as llama.cpp's converter
                                                would store them (float32 tensors)

transformers builds every reference: nothing is downloaded.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers
from gguf import GGUFWriter, quants
from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             tie_word_embeddings=False)

# case -> (config class, fields beyond SMALL, GGUF architecture)
CASES = {
    # head_dim 24 != hidden / heads = 16
    "qwen3": (transformers.Qwen3Config, dict(head_dim=24), "qwen3"),
    "olmo2": (transformers.Olmo2Config, dict(), "olmo2"),
    # layer 3 of 4 runs without rope (the default interval, 4)
    "smollm3": (transformers.SmolLM3Config, dict(tie_word_embeddings=True), "smollm3"),
    "phi3": (transformers.Phi3Config, dict(partial_rotary_factor=0.5), "phi3"),
    # (llama.cpp's qwen3moe has no dense layers: mlp_only_layers is tested on HF folders only)
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                                     norm_topk_prob=True, head_dim=16),
                  "qwen3moe"),
    # Gemma: small caps and window so that both matter (the window is 6 of the
    # tests' 20-odd tokens); query_pre_attn_scalar 24 != head_dim 16.
    # Layers 1 and 3 of 4 attend globally.
    "gemma2": (transformers.Gemma2Config, dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
                                               attn_logit_softcapping=2.0, final_logit_softcapping=2.0,
                                               tie_word_embeddings=True), "gemma2"),
    # Layer 5 of 6 is global (the default pattern, 6): it turns with rope_theta
    # 1e5 scaled by 2, the local layers with 1e4.
    "gemma3_text": (transformers.Gemma3TextConfig,
                    dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=6, num_hidden_layers=6,
                         tie_word_embeddings=True,
                         rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                          "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                             "rope_theta": 100000.0}}),
                    "gemma3"),
}
# What a family's GGUF cannot say, so its GGUF test's model does not use it:
# llama.cpp scales Gemma's q by head_dim ** -0.5 (hidden / heads in the 27B models only).
GGUF_OVERRIDES = {"gemma2": dict(query_pre_attn_scalar=16), "gemma3_text": dict(query_pre_attn_scalar=16)}
# Families whose reference must run eager attention (SDPA has no score soft-capping).
_EAGER = ("gemma2", "gemma3_text")


def random_hf_model(case: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """transformers' model of ``case`` with weights large enough that every block matters."""
    config_class, extra, _ = CASES[case]
    torch.manual_seed(seed)
    config = config_class(**{**SMALL, **extra, **overrides})
    eager = {"attn_implementation": "eager"} if case in _EAGER else {}
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, **eager)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)
            else:
                param.normal_(0.0, 0.08)
    return model.eval()


@torch.inference_mode()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0]


# HF module path inside a layer -> llama.cpp's block tensor name.
_BLOCK_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate_up_proj": "ffn_up", "mlp.gate": "ffn_gate_inp",
}
# OLMo 2's post_attention_layernorm norms attention's output (no pre-norms at all).
_GEMMA_BLOCK_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm"}
_FAMILY_BLOCK_NAMES = {"olmo2": {"post_attention_layernorm": "post_attention_norm"},
                       "gemma2": _GEMMA_BLOCK_NAMES, "gemma3": _GEMMA_BLOCK_NAMES}
# The converter stores Gemma's RMSNorm weights + 1 (llama.cpp norms compute x * weight).
_NORM_SHIFTED = ("gemma2", "gemma3")
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}
_PERMUTED = ("llama", "smollm3")  # the converter reorders q/k rows for llama.cpp's interleaved rope


def gguf_tensors(model, arch: str) -> dict[str, np.ndarray]:
    """llama.cpp's name -> float32 values in its row order, experts stacked."""
    config = model.config
    block_names = {**_BLOCK_NAMES, **_FAMILY_BLOCK_NAMES.get(arch, {})}
    tensors = {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        values = tensor.float().numpy()
        if arch in _NORM_SHIFTED and hf_name.endswith("norm.weight"):
            values = values + 1
        if hf_name in _GLOBAL_NAMES:
            tensors[_GLOBAL_NAMES[hf_name]] = values
            continue
        _, _, layer, rest = hf_name.split(".", 3)
        module, _, kind = rest.rpartition(".")
        if module == "mlp.experts":  # transformers' stacked experts: gate_up_proj [E, 2I, H], down_proj [E, H, I]
            if kind == "gate_up_proj":
                gate, up = np.split(values, 2, axis=1)
                tensors[f"blk.{layer}.ffn_gate_exps.weight"] = gate
                tensors[f"blk.{layer}.ffn_up_exps.weight"] = up
            else:
                tensors[f"blk.{layer}.ffn_down_exps.weight"] = values
            continue
        key = block_names[module]
        heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(key)
        if arch in _PERMUTED and heads:
            values = llama_cpp_permute(values, heads)
        tensors[f"blk.{layer}.{key}.{kind}"] = values
    return tensors


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The converter's reorder: per head, rows (half j, index i) move to row 2*i + j."""
    rows = weight.shape[0]
    by_half = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return by_half.swapaxes(1, 2).reshape(weight.shape)


def write_gguf(path, model, arch: str, types: dict | None = None) -> None:
    """The model as a float32 GGUF of architecture ``arch``, named as llama.cpp names it;
    ``types``: tensor kind (``ffn_up_exps``) -> a type of llama.cpp's reference quantizer to store it in."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    writer = GGUFWriter(str(path), arch)
    for key, value in {
        "block_count": config.num_hidden_layers, "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size, "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "attention.key_length": head_dim, "attention.value_length": head_dim,
        "rope.dimension_count": rotary_dim, "vocab_size": config.vocab_size,
    }.items():
        writer.add_uint32(f"{arch}.{key}", value)
    if getattr(config, "num_experts", None):
        writer.add_uint32(f"{arch}.expert_count", config.num_experts)
        writer.add_uint32(f"{arch}.expert_used_count", config.num_experts_per_tok)
        writer.add_uint32(f"{arch}.expert_feed_forward_length", config.moe_intermediate_size)
    if arch in _NORM_SHIFTED:
        _add_gemma_metadata(writer, arch, config)
        rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' rope
    writer.add_float32(f"{arch}.rope.freq_base", rope.get("rope_theta", 10000.0))
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    allowed = allowed_tensor_names(arch, config.num_hidden_layers)
    for name, values in gguf_tensors(model, arch).items():
        assert name.rsplit(".", 1)[0] in allowed, f"{name} is not a llama.cpp {arch} tensor"
        ggml_type = (types or {}).get(name.split(".")[-2])
        if ggml_type is not None:
            writer.add_tensor(name, quants.quantize(np.ascontiguousarray(values, dtype=np.float32), ggml_type),
                              raw_dtype=ggml_type)
            continue
        writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_gemma_metadata(writer: GGUFWriter, arch: str, config) -> None:
    """What llama.cpp's converter writes beyond the common keys (Gemma 3's local rope and
    layer pattern are llama.cpp's defaults: 10000 and every 6th layer global)."""
    head_dim = config.head_dim
    assert config.query_pre_attn_scalar == head_dim, "llama.cpp scales q by head_dim ** -0.5 (GGUF_OVERRIDES)"
    writer.add_uint32(f"{arch}.attention.sliding_window", config.sliding_window)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, key, None) is not None:
            writer.add_float32(f"{arch}.{key}", getattr(config, key))
    full_rope = config.rope_parameters.get("full_attention", {})
    if full_rope.get("rope_type") == "linear":
        writer.add_string(f"{arch}.rope.scaling.type", "linear")
        writer.add_float32(f"{arch}.rope.scaling.factor", full_rope["factor"])


def allowed_tensor_names(arch: str, num_layers: int) -> set[str]:
    """Tensor names (without .weight) the gguf package lists for ``arch``."""
    arch_id = next(a for a, name in MODEL_ARCH_NAMES.items() if name == arch)
    return {TENSOR_NAMES[t].format(bid=b) for t in MODEL_TENSORS[arch_id] for b in range(num_layers)}
