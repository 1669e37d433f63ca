"""Weights kept in GGUF blocks: the C kernel and the PyTorch fallback against dequantize-then-matmul.

Each product path runs wherever the suite runs: the kernel as this CPU builds
it (AVX2 FMA on an AVX2 machine), built with AVX2 hidden (portable C), and
no kernel at all (PyTorch dequantizes per call). Blocks are random but valid
(``ggml_blocks.random_blocks``) and decoded for reference by the independent
decoders of ``ggml_blocks``.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGMLType

from tests.models import ggml_blocks
from tests.models.test_gguf_loading import CONFIG, TYPES, direct_model, logits, random_checkpoint, write_gguf
from cadence import cpu_features
from cadence.kernels.quant_matmul import quant_matmul
from cadence.models import quantized
from cadence.models.gguf_loader import load_gguf_model, read_gguf
from cadence.models.quantized import KERNEL_TYPES, QuantizedTensor, keeps_quantized

KINDS = [t.name for t in KERNEL_TYPES]
# product path -> CPU features hidden to take it (None: no kernel, PyTorch)
PATHS = {"as-built": (), "portable-c": ("avx2",), "pytorch": None}


def kernel_for(path):
    hidden = PATHS[path]
    if hidden is None:
        return None
    features = cpu_features.with_hidden(cpu_features.detect(), *hidden)
    if hidden and not features.is_x86:
        pytest.skip("hiding AVX2 is an x86 path")
    kernel = quant_matmul(features.compiler_arch())
    if kernel is None:
        pytest.skip("no C compiler here: the PyTorch path is the only one")
    return kernel


def random_matrix(kind, rows, cols, seed=0):
    """(QuantizedTensor, float32 reference decoding [rows, cols])."""
    rng = np.random.default_rng(seed)
    raw = ggml_blocks.random_blocks(kind, rows * cols // ggml_blocks.BLOCK_VALUES[kind], rng).reshape(rows, -1)
    weight = QuantizedTensor.from_gguf(GGMLType[kind], raw, (rows, cols))
    return weight, torch.from_numpy(ggml_blocks.dequantize(kind, raw, (rows, cols)))


def test_each_path_is_the_one_named():
    assert kernel_for("portable-c").isa == "portable C"
    if cpu_features.detect().has("avx2", "fma"):
        assert kernel_for("as-built").isa == "AVX2 FMA"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_product_equals_dequantize_then_matmul(kind, path):
    kernel = kernel_for(path)
    weight, reference = random_matrix(kind, rows=37, cols=512)  # 37: a ragged last tile
    for num_rows in (1, 3, 4, 9, 70):  # decode in registers (<= 4 rows) and per tile
        x = torch.randn(num_rows, 512, generator=torch.Generator().manual_seed(num_rows))
        expected = x.double() @ reference.double().T
        got = quantized.matmul(x, weight, kernel)
        assert got.shape == (num_rows, 37) and got.dtype == torch.float32
        scale = expected.abs().max().item()
        torch.testing.assert_close(got.double(), expected, atol=2e-6 * scale, rtol=0)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_embedding_rows_decode_exactly(kind, path):
    weight, reference = random_matrix(kind, rows=20, cols=256)
    ids = torch.tensor([[3, 0], [19, 3]])
    got = quantized.embedding(ids, weight, kernel_for(path), torch.float32)
    torch.testing.assert_close(got, reference[ids], atol=0, rtol=0)


def test_bfloat16_activations_come_back_in_their_dtype():
    weight, reference = random_matrix("Q4_1", rows=8, cols=64)
    x = torch.randn(2, 64).to(torch.bfloat16)
    got = quantized.matmul(x, weight, kernel_for("as-built"))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), x.float() @ reference.T, atol=0.05, rtol=0.02)


def test_kernel_refuses_rows_of_the_wrong_width():
    weight, _ = random_matrix("Q8_0", rows=4, cols=64)
    with pytest.raises(ValueError, match="float32"):
        kernel_for("portable-c").matmul(torch.randn(2, 32), weight.blocks, int(weight.ggml_type), 64)


def test_parts_of_different_types_concatenate():
    first, first_ref = random_matrix("Q4_0", rows=6, cols=256, seed=1)
    second, second_ref = random_matrix("Q4_K", rows=3, cols=256, seed=2)
    third, third_ref = random_matrix("Q4_0", rows=2, cols=256, seed=3)
    parts = quantized.merge_parts([first, third, second, torch.ones(1, 256)])
    assert [p.shape[0] for p in parts] == [8, 3, 1]  # the two Q4_0 shards stacked
    x = torch.randn(2, 256)
    expected = x @ torch.cat([first_ref, third_ref, second_ref, torch.ones(1, 256)]).T
    torch.testing.assert_close(quantized.linear(x, parts, None, None), expected, atol=1e-4, rtol=1e-5)


def test_unsupported_quant_type_names_itself_and_the_supported_list():
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_down\.weight' has type Q6_K.*Q8_0, Q4_0, Q4_1, Q4_K"):
        keeps_quantized("blk.0.ffn_down.weight", GGMLType.Q6_K, "gguf")
    assert not keeps_quantized("blk.0.ffn_down.weight", GGMLType.Q6_K, "auto")
    assert not keeps_quantized("blk.0.ffn_up.weight", GGMLType.Q4_1, "none")
    assert not keeps_quantized("blk.0.attn_norm.weight", GGMLType.F32, "gguf")
    with pytest.raises(ValueError, match="quantization: must be one of auto, gguf, none"):
        keeps_quantized("x", GGMLType.Q4_1, "int4")


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    """A tiny llama GGUF whose tensors take every type (TYPES: q Q4_0, k Q8_0, v Q4_K, ...)."""
    path = tmp_path_factory.mktemp("quantized") / "mixed.gguf"
    decoded = write_gguf(path, CONFIG, random_checkpoint(CONFIG))
    return str(path), direct_model(CONFIG, decoded)


@pytest.mark.parametrize("path", PATHS)
def test_gguf_kept_quantized_gives_the_dequantized_logits(mixed_gguf, path):
    file, reference = mixed_gguf
    model, _ = load_gguf_model(*read_gguf(file), quantization="auto")
    model.use_quant_kernel(kernel_for(path))
    qkv = model.model.layers[0].self_attn.qkv_proj.quantized
    assert [p.ggml_type for p in qkv] == [GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.Q4_K]
    assert model.model.embed_tokens.quantized.ggml_type == GGMLType.Q8_0
    assert model.model.layers[0].mlp.down_proj.quantized is None  # Q6_K: no kernel, dequantized
    ids = list(range(3, 40))
    expected = logits(reference, ids)  # up to ~700: float32 sums in another order differ by ~1e-6 of that
    torch.testing.assert_close(logits(model, ids), expected, atol=4e-6 * expected.abs().max().item(), rtol=0)


def test_gguf_mode_refuses_the_file_naming_the_tensor(mixed_gguf):
    file, _ = mixed_gguf
    assert TYPES["ffn_down"] == GGMLType.Q6_K
    with pytest.raises(ValueError, match=r"quantization gguf: GGUF tensor 'blk\.0\.ffn_down\.weight' has type Q6_K"):
        load_gguf_model(*read_gguf(file), quantization="gguf")


def test_none_keeps_every_weight_float(mixed_gguf):
    file, reference = mixed_gguf
    model, _ = load_gguf_model(*read_gguf(file), quantization="none")
    assert model.quantized_weights() == []
    ids = list(range(3, 40))
    torch.testing.assert_close(logits(model, ids), logits(reference, ids), atol=1e-5, rtol=1e-5)
