"""Load a Llama-family model from a GGUF file (or the shards of a split one: ``gguf_split``).

Steps: decode the metadata -> ``ModelConfig`` -> for each tensor, dequantize
(or keep its blocks: ``quantization`` auto/gguf, see ``cadence.models.quantized``),
rename to the Hugging Face name, undo llama.cpp's q/k row permutation ->
``LlamaForCausalLM.load_weights``.

Why the permutation: for ``general.architecture == "llama"`` llama.cpp's
converter reorders the rows of q_proj and k_proj so its interleaved rope
(pairs (0,1), (2,3), ...) computes what HF's rotate_half rope computes on
pairs (i, i + D/2). Within each head of D rows:

    HF row    (half j, index i)   j in {0, 1}, i in [0, D/2)
    GGUF row  2*i + j

We use the HF convention, so the rows go back. Files of the families llama.cpp
runs with the rotate_half ("NEOX") layout (Qwen2/3, OLMo 2, Phi-3) are not
permuted: ``Architecture.gguf_rope_permuted`` says which.

Gemma files hold every RMSNorm weight plus one: the converter folds Gemma's
``x * (1 + weight)`` into the weight (llama.cpp's norm is ``x * weight``).
``Architecture.gguf_norm_shift`` says by how much; it comes off again here,
so the model computes ``1 + weight`` as from a Hugging Face folder.

Mixture-of-experts files stack the experts (``blk.N.ffn_up_exps.weight``
[E, I, H]); each expert's slice goes in under its Hugging Face name, as
blocks (expert e's I rows of blocks from row e * I) where the type is kept.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Iterator

import torch

from cadence.models.architectures import ARCHITECTURES
from cadence.models.config import ModelConfig
from cadence.models.dequant import FLOAT_TYPES, to_torch
from cadence.models.gguf_file import GGUFFile, GGUFTensor
from cadence.models.gguf_split import GGUFSplit, open_gguf
from cadence.models.llama import LlamaForCausalLM
from cadence.models.quantized import QuantizedTensor, keeps_quantized

# GGUF tensor name -> HF name, for tensors outside the blocks.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# blk.N.<key>.<kind> -> model.layers.N.<value>.<kind>
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",  # OLMo 2: the norm on attention's output
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_gate_inp": "mlp.gate",
}
# Families whose files give a name another meaning: Phi-3's ffn_up holds gate|up.
# Gemma's ffn_norm is the norm before the MLP, post_attention_norm the one on attention's output.
_GEMMA_BLOCK_NAMES = {"ffn_norm": "pre_feedforward_layernorm"}
_FAMILY_BLOCK_NAMES = {"phi3": {"ffn_up": "mlp.gate_up_proj"}, "gemma2": _GEMMA_BLOCK_NAMES,
                       "gemma3_text": _GEMMA_BLOCK_NAMES}
# Stacked experts [E, rows, cols] -> each expert's HF projection.
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Precomputed rope frequency divisors (llama3 scaling); read into the config.
_ROPE_FREQS = "rope_freqs.weight"


def read_gguf(path: str) -> tuple[GGUFFile | GGUFSplit, dict[str, Any]]:
    """Open a GGUF file (memory-mapped) and decode its metadata; a shard of a split
    model (``name-00001-of-00003.gguf``) opens every shard, as one model."""
    reader = open_gguf(path)
    return reader, read_metadata(reader)


def read_metadata(reader: GGUFFile | GGUFSplit) -> dict[str, Any]:
    """All key/values as Python values: str, int, float, bool, or lists of them."""
    return reader.metadata


def gguf_model_config(reader: GGUFFile | GGUFSplit, metadata: dict[str, Any]) -> ModelConfig:
    """``ModelConfig`` from metadata plus what only the tensor list tells."""
    names = {t.name for t in reader.tensors}
    config = ModelConfig.from_gguf_metadata(metadata, tie_word_embeddings="output.weight" not in names)
    if "blk.0.attn_q.bias" in names:
        config = config.replace(attention_bias=True)
    if _ROPE_FREQS in names:
        factors = _tensor(reader, _ROPE_FREQS).data
        config = config.replace(rope_scaling={"rope_type": "freq_factors",
                                              "factors": tuple(float(f) for f in factors)})
    return config


def load_gguf_model(reader: GGUFFile | GGUFSplit, metadata: dict[str, Any], dtype: torch.dtype = torch.float32,
                    quantization: str = "none") -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model a GGUF describes, weights dequantized to ``dtype``, or, with
    ``quantization`` auto or gguf, the matmul weights of a quantized kernel's type
    kept in their blocks (``keeps_quantized`` says which; stacked experts too, per expert)."""
    config = gguf_model_config(reader, metadata)
    model = LlamaForCausalLM(config, dtype)
    model.load_weights(_hf_named_tensors(reader, config, dtype, quantization))
    if quantization == "auto":  # the block types keeps_quantized turned away
        model.dequantized_at_load = dict(Counter(
            t.tensor_type.name for t in reader.tensors
            if t.tensor_type not in FLOAT_TYPES and not keeps_quantized(t.name, t.tensor_type, quantization)))
    return model.eval(), config


def hf_tensor_name(gguf_name: str, architecture: str = "llama") -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (in ``architecture``)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = {**_BLOCK_NAMES, **_FAMILY_BLOCK_NAMES.get(architecture, {})}
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in names:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a {architecture} model")
    layer, key, kind = match.groups()
    return f"model.layers.{layer}.{names[key]}.{kind}"


def expert_tensor_names(gguf_name: str, num_experts: int) -> list[str] | None:
    """HF names of each expert's slice of ``blk.N.ffn_*_exps.weight``; None for other tensors."""
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _EXPERT_NAMES:
        return None
    layer, key, kind = match.groups()
    return [f"model.layers.{layer}.mlp.experts.{e}.{_EXPERT_NAMES[key]}.{kind}" for e in range(num_experts)]


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (see module doc). weight [num_heads*D, ...] or bias [num_heads*D]."""
    rows, rest = weight.shape[0], weight.shape[1:]
    half = rows // num_heads // 2
    by_pair = weight.reshape(num_heads, half, 2, *rest)  # GGUF: row 2*i + j
    return by_pair.transpose(1, 2).reshape(rows, *rest)  # HF: row j*(D/2) + i


def _hf_named_tensors(reader: GGUFFile | GGUFSplit, config: ModelConfig, dtype: torch.dtype,
                      quantization: str = "none") -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """(HF name, tensor) for every weight, permutation undone, one tensor at a time."""
    family = ARCHITECTURES[config.architecture]
    permuted, norm_shift = family.gguf_rope_permuted, family.gguf_norm_shift
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:
            continue
        expert_names = expert_tensor_names(tensor.name, config.num_experts)
        # Fails fast on tensors we have no place for.
        name = None if expert_names else hf_tensor_name(tensor.name, config.architecture)
        shape = tuple(reversed([int(n) for n in tensor.shape]))  # GGUF lists dims fastest-first
        matrix = len(shape) == (3 if expert_names else 2)
        if matrix and keeps_quantized(tensor.name, tensor.tensor_type, quantization):
            rows = shape[0] if len(shape) == 2 else shape[0] * shape[1]  # experts: every expert's rows
            value = QuantizedTensor.from_gguf(tensor.tensor_type, tensor.data, (rows, shape[-1]))
        else:
            value = to_torch(tensor.name, tensor.tensor_type, tensor.data, shape, dtype)
        reader.drop_pages(tensor)  # value owns a copy: the mapped bytes need not stay in memory
        if expert_names:
            yield from zip(expert_names, _experts_of(value, shape))
            continue
        kind = tensor.name.split(".")[-2]  # "attn_q" in "blk.3.attn_q.weight"
        if permuted and kind in heads and isinstance(value, QuantizedTensor):
            value = value.with_blocks(unpermute_rope_rows(value.blocks, heads[kind]))  # whole rows move
        elif permuted and kind in heads:
            value = unpermute_rope_rows(value, heads[kind])
        if norm_shift and kind.endswith("norm"):
            value = (value.float() - norm_shift).to(dtype)
        yield name, value


def _experts_of(value: torch.Tensor | QuantizedTensor, shape: tuple[int, ...]) -> list:
    """Each expert's matrix [rows, cols] of a stacked tensor [E, rows, cols]: for blocks, its
    run of rows (``E * rows`` block rows, expert e's contiguous from ``e * rows``), views of one copy."""
    if isinstance(value, torch.Tensor):
        return list(value)
    rows = shape[1]
    return [value.with_blocks(value.blocks[e * rows:(e + 1) * rows]) for e in range(shape[0])]


def _tensor(reader: GGUFFile | GGUFSplit, name: str) -> GGUFTensor:
    return next(t for t in reader.tensors if t.name == name)
