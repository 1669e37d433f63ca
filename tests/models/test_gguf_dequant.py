"""cadence's GGUF tensor decoding against independent block decoders (ggml_blocks)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGMLType
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES

from tests.models import ggml_blocks
from cadence.models.dequant import SUPPORTED_TYPES, to_torch

# The block types the reference decodes independently (every type with a kernel).
BLOCK_KINDS = [kind for kind in ggml_blocks.BLOCK_BYTES if ggml_blocks.decodes(kind)]


@pytest.mark.parametrize("kind", BLOCK_KINDS)
def test_random_blocks_decode_like_the_reference(kind):
    rng = np.random.default_rng(0)
    rows, cols = 4, 2 * ggml_blocks.BLOCK_VALUES[kind]
    raw = ggml_blocks.random_blocks(kind, rows * 2, rng).reshape(rows, -1)

    got = to_torch("w", GGMLType[kind], raw, (rows, cols), torch.float32)

    expected = ggml_blocks.dequantize(kind, raw, (rows, cols))
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantized_real_values_decode_close_to_the_originals(kind):
    # gguf.quants.quantize ports llama.cpp's reference quantizer: a realistic file.
    values = np.random.default_rng(1).normal(size=(8, 64)).astype(np.float32)
    raw = quants.quantize(values, GGMLType[kind])

    got = to_torch("w", GGMLType[kind], raw, values.shape, torch.float32).numpy()

    np.testing.assert_allclose(got, ggml_blocks.dequantize(kind, raw, values.shape), rtol=1e-6, atol=1e-7)
    step = {"Q8_0": 127, "Q4_0": 7, "Q4_1": 15, "Q5_0": 15, "Q5_1": 31}[kind]  # levels per block range
    assert np.abs(got - values).max() <= 2 * np.abs(values).max() / step


@pytest.mark.parametrize("numpy_dtype", [np.float32, np.float16])
def test_float_tensors_are_exact(numpy_dtype):
    values = np.random.default_rng(2).normal(size=(3, 5)).astype(numpy_dtype)
    kind = GGMLType.F32 if numpy_dtype == np.float32 else GGMLType.F16

    got = to_torch("w", kind, values, (3, 5), torch.float32)

    assert torch.equal(got, torch.from_numpy(values.astype(np.float32)))


def test_bf16_bytes_are_reinterpreted_exactly():
    values = torch.randn(3, 8).to(torch.bfloat16)
    raw = values.view(torch.int16).numpy().view(np.uint8)  # what GGUFReader hands over

    got = to_torch("w", GGMLType.BF16, raw, (3, 8), torch.bfloat16)

    assert torch.equal(got, values)


def test_result_is_cast_to_the_requested_dtype():
    raw = quants.quantize(np.ones((2, 32), dtype=np.float32), GGMLType.Q8_0)
    assert to_torch("w", GGMLType.Q8_0, raw, (2, 32), torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("kind", [t for t in SUPPORTED_TYPES if t.name not in ("F32", "F16", "BF16")])
def test_a_zero_block_of_every_supported_type_decodes_to_zeros(kind):
    values_per_block, block_bytes = GGML_QUANT_SIZES[kind]
    raw = np.zeros((2, 2 * block_bytes), dtype=np.uint8)
    got = to_torch("w", kind, raw, (2, 2 * values_per_block), torch.float32)
    assert got.shape == (2, 2 * values_per_block) and not got.any()


@pytest.mark.parametrize("kind", [GGMLType.Q8_K, GGMLType.Q8_1, GGMLType.F64, GGMLType.I8])
def test_unsupported_type_raises_naming_tensor_and_type(kind):
    assert kind not in SUPPORTED_TYPES
    raw = np.zeros((1, 256), dtype=np.uint8)
    with pytest.raises(ValueError, match=rf"'blk\.0\.attn_q\.weight'.*{kind.name}"):
        to_torch("blk.0.attn_q.weight", kind, raw, (1, 256), torch.float32)
