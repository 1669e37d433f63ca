"""GGUF files written here from known weights, then loaded by cadence.

The writer side does what llama.cpp's converter does (permute q/k rows for the
llama architecture, store rope_freqs for llama3 scaling), written from its
description, so a loader that forgets to undo something shows up as a
logits mismatch against the same weights loaded directly.
"""

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGMLType
from gguf import GGUFWriter, quants
from gguf.constants import GGML_QUANT_SIZES

from tests.models import ggml_blocks
from cadence.models.attention_ref import ReferenceAttention
from cadence.models.dequant import SUPPORTED_TYPES
from cadence.models.gguf_loader import hf_tensor_name, load_gguf_model, read_gguf, unpermute_rope_rows
from cadence.models.llama import LlamaForCausalLM
from cadence.models.testing import hf_checkpoint, random_model, tiny_config

# K-quants need rows that are multiples of 256 values.
CONFIG = tiny_config(vocab_size=256, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64, num_hidden_layers=2, rope_theta=10000.0)

# The storage type of each tensor kind: the float types and the 4- and 8-bit block types.
TYPES = {
    "token_embd": GGMLType.Q8_0, "attn_q": GGMLType.Q4_0, "attn_k": GGMLType.Q8_0,
    "attn_v": GGMLType.Q4_K, "attn_output": GGMLType.Q4_1, "ffn_gate": GGMLType.F16,
    "ffn_up": GGMLType.BF16, "ffn_down": GGMLType.Q6_K, "output": GGMLType.Q6_K,
    "attn_norm": GGMLType.F32, "ffn_norm": GGMLType.F32, "output_norm": GGMLType.F32,
}
# The 5-bit, 2- and 3-bit K and IQ4 block types, and a gate in TQ2_0, which only dequantizing loads.
TYPES_5_BIT = {
    **TYPES, "token_embd": GGMLType.Q5_0, "attn_q": GGMLType.Q5_0, "attn_k": GGMLType.Q5_1,
    "attn_v": GGMLType.Q5_K, "attn_output": GGMLType.Q2_K, "ffn_gate": GGMLType.TQ2_0,
    "ffn_up": GGMLType.IQ4_NL, "ffn_down": GGMLType.Q3_K, "output": GGMLType.IQ4_XS,
}
SUPPORTED_TYPE_NAMES = {t.name for t in SUPPORTED_TYPES}
GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
BLOCK_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name):
    if hf_name in GGUF_NAMES:
        return GGUF_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{BLOCK_NAMES[module]}.{kind}"


def llama_cpp_permute(weight, num_heads):
    """The converter's reorder: per head, rows (half j, index i) move to row 2*i + j."""
    rows = weight.shape[0]
    by_half = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return by_half.swapaxes(1, 2).reshape(weight.shape)


def encode(name, values, ggml_type, rng):
    """(bytes or values to write, what they decode to). K- and IQ-quants: random blocks;
    a type cadence must refuse: zero bytes, decoding to NaN (nothing to compare)."""
    if ggml_type in (GGMLType.F32, GGMLType.F16):
        stored = values.astype(np.float32 if ggml_type == GGMLType.F32 else np.float16)
        return stored, stored.astype(np.float32)
    if ggml_type == GGMLType.BF16:
        stored = torch.from_numpy(values).to(torch.bfloat16)
        return stored.view(torch.int16).numpy().view(np.uint8), stored.float().numpy()
    kind = ggml_type.name
    if kind not in SUPPORTED_TYPE_NAMES:
        values_per_block, block_bytes = GGML_QUANT_SIZES[ggml_type]
        raw = np.zeros((values.shape[0], values.shape[1] // values_per_block * block_bytes), dtype=np.uint8)
        return raw, np.full(values.shape, np.nan, dtype=np.float32)
    if kind in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        raw = quants.quantize(values, ggml_type)  # llama.cpp's reference quantizer
    else:
        num_blocks = values.size // ggml_blocks.BLOCK_VALUES[kind]
        raw = ggml_blocks.random_blocks(kind, num_blocks, rng).reshape(values.shape[0], -1)
    if not ggml_blocks.decodes(kind):  # only gguf.quants decodes it: the reference for the loader
        return raw, quants.dequantize(raw, ggml_type).reshape(values.shape)
    return raw, ggml_blocks.dequantize(kind, raw, values.shape)


def write_gguf(path, config, checkpoint, arch="llama", types=TYPES, rope_freqs=None):
    """Write ``checkpoint`` (HF names, HF row order) as llama.cpp would; return what it decodes to."""
    writer = GGUFWriter(str(path), arch)
    for key, value in {
        "block_count": config.num_hidden_layers, "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size, "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "rope.dimension_count": config.head_dim, "vocab_size": config.vocab_size,
    }.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", config.rope_theta)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    rng = np.random.default_rng(0)
    decoded = {}
    for hf_name, tensor in checkpoint.items():
        name = gguf_name(hf_name)
        kind = name.split(".")[-2]  # "attn_q", "token_embd", ...
        values = tensor.numpy().astype(np.float32)
        heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(kind)
        row_order = np.arange(values.shape[0])
        if arch == "llama" and heads:
            row_order = llama_cpp_permute(row_order, heads)
        stored, stored_decoded = encode(name, values[row_order], types[kind], rng)
        writer.add_tensor(name, stored, raw_dtype=types[kind])
        decoded[hf_name] = np.empty_like(stored_decoded)
        decoded[hf_name][row_order] = stored_decoded  # back to HF row order
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {name: torch.from_numpy(values) for name, values in decoded.items()}


def random_checkpoint(config, seed=1):
    """HF-named weights of a random model of ``config`` (larger spread than the default init)."""
    model = random_model(config, seed=seed)
    return {name: value * 2.5 if not name.endswith("norm.weight") else value
            for name, value in hf_checkpoint(model).items()}


def logits(model, ids):
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), ReferenceAttention()))


def direct_model(config, decoded):
    model = LlamaForCausalLM(config)
    model.load_weights(decoded.items())
    return model.eval()


IDS = list(range(3, 40))


@pytest.mark.parametrize("types", [TYPES, TYPES_5_BIT], ids=["4-bit", "5-bit"])
def test_quantized_llama_gguf_loads_the_written_weights(tmp_path, types):
    decoded = write_gguf(tmp_path / "m.gguf", CONFIG, random_checkpoint(CONFIG), types=types)
    model, config = load_gguf_model(*read_gguf(str(tmp_path / "m.gguf")))
    assert config == CONFIG.replace(bos_token_id=None)
    torch.testing.assert_close(logits(model, IDS), logits(direct_model(CONFIG, decoded), IDS), atol=1e-5, rtol=1e-5)


def test_loading_without_unpermuting_would_be_wrong(tmp_path):
    """Guard against a vacuous pass: a loader skipping the unpermute gets other logits."""
    decoded = write_gguf(tmp_path / "m.gguf", CONFIG, random_checkpoint(CONFIG))
    heads = {"q_proj": CONFIG.num_attention_heads, "k_proj": CONFIG.num_key_value_heads}
    as_stored = {name: llama_cpp_permute(value, heads[name.split(".")[-2]]) if name.split(".")[-2] in heads
                 else value for name, value in decoded.items()}
    model, _ = load_gguf_model(*read_gguf(str(tmp_path / "m.gguf")))
    assert not torch.allclose(logits(model, IDS), logits(direct_model(CONFIG, as_stored), IDS), atol=1e-3)


def test_qwen2_gguf_is_not_permuted_and_keeps_biases(tmp_path):
    config = CONFIG.replace(architecture="qwen2", attention_bias=True, tie_word_embeddings=True)
    checkpoint = random_checkpoint(config)
    types = {**TYPES, "attn_q": GGMLType.F32, "attn_k": GGMLType.F32, "attn_v": GGMLType.F32}
    decoded = write_gguf(tmp_path / "q.gguf", config, checkpoint, arch="qwen2", types=types)
    model, loaded = load_gguf_model(*read_gguf(str(tmp_path / "q.gguf")))
    assert loaded.attention_bias and loaded.tie_word_embeddings and loaded.architecture == "qwen2"
    torch.testing.assert_close(logits(model, IDS), logits(direct_model(config, decoded), IDS), atol=1e-5, rtol=1e-5)


def llama_cpp_rope_factors(config, scaling):
    """rope_freqs.weight as llama.cpp's converter computes it for llama3 scaling."""
    factors = []
    for i in range(0, config.head_dim, 2):
        wavelength = 2 * math.pi * config.rope_theta ** (i / config.head_dim)
        old_len = scaling["original_max_position_embeddings"]
        if wavelength < old_len / scaling["high_freq_factor"]:
            factors.append(1.0)
        elif wavelength > old_len / scaling["low_freq_factor"]:
            factors.append(scaling["factor"])
        else:
            smooth = (old_len / wavelength - scaling["low_freq_factor"]) / (
                scaling["high_freq_factor"] - scaling["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / scaling["factor"] + smooth))
    return factors


def test_rope_freqs_tensor_reproduces_llama3_scaling(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    hf_config = CONFIG.replace(rope_scaling=scaling, rope_theta=500000.0)
    types = {k: GGMLType.F32 for k in TYPES}
    decoded = write_gguf(tmp_path / "r.gguf", hf_config, random_checkpoint(hf_config),
                         types=types, rope_freqs=llama_cpp_rope_factors(hf_config, scaling))
    model, config = load_gguf_model(*read_gguf(str(tmp_path / "r.gguf")))
    assert config.rope_scaling["rope_type"] == "freq_factors"
    ids = list(range(200))
    torch.testing.assert_close(logits(model, ids), logits(direct_model(hf_config, decoded), ids),
                               atol=1e-4, rtol=1e-4)


def test_unsupported_tensor_type_in_file_names_the_tensor(tmp_path):
    types = {**TYPES, "ffn_gate": GGMLType.Q8_K}  # llama.cpp's activation type, never a weight's
    write_gguf(tmp_path / "u.gguf", CONFIG, random_checkpoint(CONFIG), types=types)
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_gate\.weight' has type Q8_K, which cadence cannot load"):
        load_gguf_model(*read_gguf(str(tmp_path / "u.gguf")))


def test_tensor_names():
    assert hf_tensor_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    assert hf_tensor_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")


def test_unpermute_inverts_the_converter_permutation():
    weight = torch.randn(4 * 8, 5)
    torch.testing.assert_close(unpermute_rope_rows(llama_cpp_permute(weight, 4), 4), weight)
    bias = torch.randn(2 * 8)
    torch.testing.assert_close(unpermute_rope_rows(llama_cpp_permute(bias, 2), 2), bias)


def interleaved_rope(x, position, theta=10000.0):
    """llama.cpp's llama-arch rope: rotate pairs (2i, 2i+1) of each head by position * theta^(-2i/D)."""
    dim = x.shape[-1]
    out = x.clone()
    for i in range(dim // 2):
        angle = position * theta ** (-2 * i / dim)
        a, b = x[..., 2 * i], x[..., 2 * i + 1]
        out[..., 2 * i] = a * math.cos(angle) - b * math.sin(angle)
        out[..., 2 * i + 1] = a * math.sin(angle) + b * math.cos(angle)
    return out


def test_unpermuted_weights_with_rotate_half_equal_gguf_weights_with_interleaved_rope():
    """What llama.cpp computes from the file == what cadence computes after unpermuting."""
    from cadence.models.rotary import RotaryEmbedding, apply_rotary

    config = tiny_config(num_attention_heads=2, num_key_value_heads=2, head_dim=16, hidden_size=32)
    rotary = RotaryEmbedding(config)
    gguf_q, gguf_k = torch.randn(32, 32), torch.randn(32, 32)  # as stored in a llama GGUF
    x, y = torch.randn(32), torch.randn(32)
    q_pos, k_pos = 9, 4

    def heads(v):
        return v.view(1, 2, 16)

    llama_cpp_scores = (interleaved_rope(heads(gguf_q @ x), q_pos) * interleaved_rope(heads(gguf_k @ y), k_pos)).sum(-1)
    q = apply_rotary(heads(unpermute_rope_rows(gguf_q, 2) @ x), *rotary(torch.tensor([q_pos]), torch.float32))
    k = apply_rotary(heads(unpermute_rope_rows(gguf_k, 2) @ y), *rotary(torch.tensor([k_pos]), torch.float32))
    torch.testing.assert_close((q * k).sum(-1), llama_cpp_scores, atol=1e-4, rtol=1e-4)
