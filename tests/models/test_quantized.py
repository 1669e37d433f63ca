"""Weights kept in GGUF blocks: the C kernel and the PyTorch fallback against dequantize-then-matmul
of the activations rounded per group of 32 to int16 steps (``ggml_blocks.round_activations``).

Each product path runs wherever the suite runs: the kernel as this CPU builds
it (AVX2 FMA on an AVX2 machine, its integer paths in AVX-512 where the CPU
has it), built with VNNI hidden (AVX-512's madd in place of vpdpwssd), with
AVX-512 hidden (the AVX2 paths), with AVX2 hidden (portable C), and
no kernel at all (PyTorch dequantizes per call). Blocks are random but valid
(``ggml_blocks.random_blocks``) and decoded for reference by the independent
decoders of ``ggml_blocks``.
"""

import io

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGMLType

from tests.models import ggml_blocks
from tests.models.test_gguf_loading import (CONFIG, TYPES, TYPES_5_BIT, direct_model, logits, random_checkpoint,
                                           write_gguf)
from cadence import cpu_features
from cadence.config import EngineOptions
from cadence.engine.builder import assemble_engine
from cadence.kernels.quant_matmul import quant_matmul
from cadence.models import quantized
from cadence.models.gguf_loader import load_gguf_model, read_gguf
from cadence.models.quantized import KERNEL_TYPES, QuantizedTensor, keeps_quantized
from cadence.models.step_buffer import StepBuffer

KINDS = [t.name for t in KERNEL_TYPES]
# product path -> CPU features hidden to take it (None: no kernel, PyTorch)
PATHS = {"as-built": (), "avx512-without-vnni": ("avx512_vnni",), "avx2": ("avx512",), "portable-c": ("avx2",),
         "pytorch": None}


def kernel_for(path):
    hidden = PATHS[path]
    if hidden is None:
        return None
    features = cpu_features.with_hidden(cpu_features.detect(), *hidden)
    if hidden and not features.is_x86:
        pytest.skip("hiding AVX2 or AVX-512 is an x86 path")
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


# Types whose products round x to int8 steps (max|x| / 127 per 256 values), as llama.cpp's do; int16's elsewhere.
BYTE_KINDS = {"Q4_K", "Q6_K"}


def rounded(x, kind="Q8_0"):
    """x as every product on ``kind``'s weights multiplies it, by the independent reference."""
    if kind in BYTE_KINDS:  # int8 steps, one per 256 values
        return torch.from_numpy(ggml_blocks.round_activations(x.numpy(), 127, 256))
    return torch.from_numpy(ggml_blocks.round_activations(x.numpy(), 32767))


def activations_with_ties():
    """Random rows, plus groups that hit the rounding's edge cases: exact halves
    (ties go to even), an all-zero group, one value that sets max|x| alone."""
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(7))
    x[1, :32] = torch.arange(32) - 15.5  # a ramp: max|x| at both ends
    x[1, 32:64] = 0.0
    halves = torch.tensor([32767.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5] * 4)
    x[2, :32] = halves  # d = 1: x * 1 are exact halves
    x[2, 32:64] = 1e-30
    x[2, 64] = 1e4
    return x


def test_each_path_is_the_one_named():
    assert kernel_for("portable-c").isa == "portable C"
    features = cpu_features.detect()
    if features.has("avx2", "fma"):
        assert kernel_for("avx2").isa == "AVX2 FMA"
        decode = {"avx512_vnni": "AVX2 FMA, AVX-512 VNNI decode and tiles", "": "AVX2 FMA, AVX-512BW decode and tiles"}
        if features.has("avx512f", "avx512bw"):
            assert kernel_for("as-built").isa == decode["avx512_vnni" if features.has("avx512_vnni") else ""]
            assert kernel_for("avx512-without-vnni").isa == decode[""]
        else:
            assert kernel_for("as-built").isa == "AVX2 FMA"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_product_equals_dequantize_then_matmul(kind, path):
    kernel = kernel_for(path)
    weight, reference = random_matrix(kind, rows=37, cols=512)  # 37: a ragged last tile
    for num_rows in (1, 3, 4, 6, 9, 12, 13, 70):  # in registers, 4 rows at a time (<= 8 or 12), and tiled
        x = torch.randn(num_rows, 512, generator=torch.Generator().manual_seed(num_rows))
        expected = rounded(x, kind).double() @ reference.double().T
        got = quantized.matmul(x, weight, kernel)
        assert got.shape == (num_rows, 37) and got.dtype == torch.float32
        scale = expected.abs().max().item()
        torch.testing.assert_close(got.double(), expected, atol=2e-6 * scale, rtol=0)


@pytest.mark.parametrize("path", ["as-built", "avx2"])
@pytest.mark.parametrize("kind", sorted(BYTE_KINDS))
def test_byte_tiles_across_panels_steps_and_row_blocks(kind, path):
    """The AVX2 build's byte tiles (quant_byte_tiles_avx2.h) decode 64 weight rows
    (a panel) 4 super-blocks (a step) at a time and pass x 16 rows at a time: 70
    rows make a second, ragged panel, 1,536 values a second, shorter step, 37 rows
    of x a ragged third row block. Every row of x equals the reference product,
    and its value alone in a product of that size (the tiles compute rows apart)."""
    kernel = kernel_for(path)
    weight, reference = random_matrix(kind, rows=70, cols=1536, seed=11)
    x = torch.randn(37, 1536, generator=torch.Generator().manual_seed(11)) * 3
    x[5, :256] = 0.0  # a super-block of zeros: step 0
    x[6, 700] = 50.0  # one value that sets its super-block's step alone
    got = quantized.matmul(x, weight, kernel)
    expected = rounded(x, kind).double() @ reference.double().T
    torch.testing.assert_close(got.double(), expected, atol=2e-6 * expected.abs().max().item(), rtol=0)
    first = (kernel.direct_max_rows if kernel is not None else 4) + 1
    for start in (0, 17, 37 - first):
        assert torch.equal(quantized.matmul(x[start:start + first], weight, kernel), got[start:start + first]), start


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", [kind for kind in KINDS if ggml_blocks.BLOCK_VALUES[kind] == 32])
def test_rows_whose_groups_end_in_a_short_run(kind, path):
    """The integer path takes the groups' scales eight at a time: 11 groups leave a run of
    three (SmolLM2's 576 columns leave two), whose missing groups must add nothing."""
    kernel = kernel_for(path)
    weight, reference = random_matrix(kind, rows=19, cols=11 * 32, seed=3)
    for num_rows in (1, 2, 4, 7, 20):
        x = torch.randn(num_rows, 11 * 32, generator=torch.Generator().manual_seed(num_rows))
        expected = rounded(x, kind).double() @ reference.double().T
        got = quantized.matmul(x, weight, kernel)
        torch.testing.assert_close(got.double(), expected, atol=2e-6 * expected.abs().max().item(), rtol=0)


@pytest.mark.parametrize("path", ["as-built", "avx512-without-vnni"])
@pytest.mark.parametrize("kind", [kind for kind in KINDS if ggml_blocks.BLOCK_VALUES[kind] == 32])
def test_decode_rows_in_pairs_at_every_row_length(kind, path):
    """With AVX-512 the decode rows take these types two groups at a time, two pairs a
    step (one masked load of two blocks with VBMI, hidden on the second path), x's
    integers laid out by pairs: 1 to 9 groups leave every mix of two-pair steps, a
    pair alone and a group alone. Each of 1 to 4 rows of x equals the reference, and
    the last row its value alone."""
    kernel = kernel_for(path)
    for groups in range(1, 10):
        cols = groups * 32
        weight, reference = random_matrix(kind, rows=5, cols=cols, seed=groups)
        x = torch.randn(4, cols, generator=torch.Generator().manual_seed(groups)) * 4
        expected = rounded(x, kind).double() @ reference.double().T
        for num_rows in (1, 2, 3, 4):
            got = quantized.matmul(x[:num_rows], weight, kernel)
            torch.testing.assert_close(got.double(), expected[:num_rows],
                                       atol=2e-6 * expected.abs().max().item(), rtol=0, msg=f"{groups} groups")
            assert torch.equal(got[num_rows - 1:], quantized.matmul(x[num_rows - 1:num_rows], weight, kernel))


@pytest.mark.parametrize("path", ["as-built", "portable-c"])
def test_activations_round_as_ggml_rounds_them(path):
    x = activations_with_ties()
    expected = rounded(x)
    assert torch.equal(kernel_for(path).round_activations(x), expected)
    assert torch.equal(quantized.round_activations(x), expected)  # the PyTorch path's own rounding
    assert torch.equal(expected[2, :8], torch.tensor([32767.0, 0.0, 2.0, 2.0, -0.0, -2.0, -2.0, 4.0]))
    assert not expected[1, 32:64].any()
    wide = torch.cat([x, x.flip(1)], dim=1)  # 256 values a row: one super-block
    for kind in BYTE_KINDS:  # int8 steps: d = max|x| / 127 over each 256 values
        type_id = GGMLType[kind].value
        as_bytes = rounded(wide, kind)
        assert torch.equal(kernel_for(path).round_activations(wide, type_id), as_bytes)
        assert torch.equal(quantized.round_activations(wide, type_id), as_bytes)
        assert torch.equal(as_bytes[2, :8], torch.tensor([32767.0, 0.0, 0.0, 0.0, -0.0, -0.0, -0.0, 0.0]))
        # row 2's random values share the step of its 32767: all round to 0 (per 32 they would not)
        assert not as_bytes[2, 96:128].any() and rounded(x, "Q8_0")[2, 96:128].all()
        assert not torch.equal(as_bytes[:, :128], rounded(x, "Q8_0"))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_products_of_edge_case_activations(kind, path):
    weight, reference = random_matrix(kind, rows=9, cols=256, seed=5)
    x = activations_with_ties()[:, :128].repeat(1, 2)
    for rows in (x[:1], x, x.repeat(3, 1)):  # integer products (<= 4 rows) and tiles
        expected = rounded(rows, kind).double() @ reference.double().T
        got = quantized.matmul(rows, weight, kernel_for(path))
        torch.testing.assert_close(got.double(), expected, atol=2e-6 * expected.abs().max().item(), rtol=0)


@pytest.mark.parametrize("path", PATHS)
def test_no_rows_give_an_empty_product(path):
    weight, _ = random_matrix("Q4_1", rows=8, cols=64)
    got = quantized.matmul(torch.empty(0, 64), weight, kernel_for(path))
    assert got.shape == (0, 8)


def test_one_rows_product_does_not_depend_on_its_batch():
    kernel = kernel_for("as-built")
    weight, _ = random_matrix("Q4_1", rows=64, cols=512, seed=4)
    num_rows = (kernel.direct_max_rows if kernel is not None else 4) + 1
    x = torch.randn(num_rows, 512, generator=torch.Generator().manual_seed(9))
    alone = torch.cat([quantized.matmul(x[i:i + 1], weight, kernel) for i in range(num_rows)])
    together = quantized.matmul(x, weight, kernel)  # the tile path
    torch.testing.assert_close(together, alone, atol=2e-6 * alone.abs().max().item(), rtol=0)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q6_K"])
def test_without_avx512_long_rows_stay_in_integers_up_to_the_row_bound(kind):
    """AVX2's tiles are float32: without AVX-512 the integer chunks take up to
    ``direct_max_rows`` rows whatever their length (2,048 values here, which
    AVX-512 sends to its integer tiles from a few rows on), each row as alone."""
    kernel = kernel_for("avx2")
    if kernel is None or kernel.direct_max_rows <= 4:
        pytest.skip("no integer path in chunks in this build")
    weight, reference = random_matrix(kind, rows=21, cols=2048, seed=10)
    x = torch.randn(kernel.direct_max_rows, 2048, generator=torch.Generator().manual_seed(10))
    alone = torch.cat([quantized.matmul(x[i:i + 1], weight, kernel) for i in range(len(x))])
    for num_rows in (6, 9, kernel.direct_max_rows):
        assert torch.equal(quantized.matmul(x[:num_rows], weight, kernel), alone[:num_rows]), num_rows
    expected = rounded(x, kind).double() @ reference.double().T
    torch.testing.assert_close(alone.double(), expected, atol=2e-6 * expected.abs().max().item(), rtol=0)


@pytest.mark.parametrize("path", ["as-built", "avx2"])
@pytest.mark.parametrize("kind", ["Q4_1", "Q5_0", "Q4_K", "Q6_K", "Q2_K"])
def test_the_tiles_compute_each_row_as_in_any_larger_product(kind, path):
    """Past ``direct_max_rows`` rows the products are tiles (integers with
    AVX-512, float32 with AVX2), a few rows of x at a time: every row's value is
    exactly the one it has in any other product past that size, whichever rows
    share its register tile (what the batch-invariant mode relies on)."""
    kernel = kernel_for(path)
    if kernel is None or kernel.direct_max_rows <= 4:
        pytest.skip("no integer path in chunks in this build: its tiles start at 5 rows")
    weight, reference = random_matrix(kind, rows=37, cols=512, seed=8)
    first = kernel.direct_max_rows + 1
    x = torch.randn(first + 30, 512, generator=torch.Generator().manual_seed(8))
    everything = quantized.matmul(x, weight, kernel)
    for start, num_rows in [(0, first), (1, first), (2, first + 1), (5, first + 7), (3, first + 27)]:
        assert torch.equal(quantized.matmul(x[start:start + num_rows], weight, kernel),
                           everything[start:start + num_rows]), (start, num_rows)
    expected = rounded(x, kind).double() @ reference.double().T
    torch.testing.assert_close(everything.double(), expected, atol=2e-6 * expected.abs().max().item(), rtol=0)


@pytest.mark.parametrize("path", ["as-built", "avx2"])
@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K", "Q6_K", "Q2_K"])
def test_the_integer_path_computes_each_row_as_alone(kind, path):
    """Up to ``direct_max_rows`` rows are products in integers, four rows at a
    time: every row's value is exactly the one it has alone, whichever chunk holds it."""
    kernel = kernel_for(path)
    if kernel is None or kernel.direct_max_rows <= 4:
        pytest.skip("no integer path in chunks in this build")
    weight, reference = random_matrix(kind, rows=37, cols=512, seed=6)
    x = torch.randn(kernel.direct_max_rows, 512, generator=torch.Generator().manual_seed(6))
    alone = torch.cat([quantized.matmul(x[i:i + 1], weight, kernel) for i in range(len(x))])
    for num_rows in range(5, kernel.direct_max_rows + 1):  # full and ragged last chunks
        assert torch.equal(quantized.matmul(x[:num_rows], weight, kernel), alone[:num_rows]), num_rows
    expected = rounded(x, kind).double() @ reference.double().T
    torch.testing.assert_close(alone.double(), expected, atol=1e-4 * expected.abs().max().item(), rtol=0)


@pytest.mark.parametrize("path", ["as-built", "avx2", "portable-c"])
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K", "Q2_K", "IQ4_XS"])
def test_rows_apart_products_compute_every_row_as_alone(kind, path):
    """The batch-invariant mode's products (``rows_apart``): at any number of rows,
    prefill-sized ones and blocks of x past L2 included (64 rows of 2,048 values
    are two blocks), each row's value is exactly the one it has alone; where the
    build has an integer path, that is the value a one-row decode step computes."""
    kernel = kernel_for(path)
    rows_apart = kernel.rows_apart()
    assert rows_apart.computes_rows_apart and not kernel.computes_rows_apart
    weight, reference = random_matrix(kind, rows=23, cols=2048, seed=12)
    x = torch.randn(70, 2048, generator=torch.Generator().manual_seed(12))
    alone = torch.cat([quantized.matmul(x[i:i + 1], weight, kernel) for i in range(len(x))])
    for start, num_rows in [(0, 1), (3, 5), (0, 17), (1, 33), (0, 64), (2, 68)]:
        got = quantized.matmul(x[start:start + num_rows], weight, rows_apart)
        assert torch.equal(got, alone[start:start + num_rows]), (start, num_rows)
    expected = rounded(x, kind).double() @ reference.double().T
    torch.testing.assert_close(alone.double(), expected, atol=1e-4 * expected.abs().max().item(), rtol=0)


def test_rows_apart_products_differ_from_the_tiles_where_the_build_has_both():
    """What the mode changes: past ``direct_max_rows`` rows the kernel's own products are
    tiles (other float sums than a row's alone); the rows-apart ones are not."""
    kernel = kernel_for("as-built")
    if kernel.direct_max_rows == 0:
        pytest.skip("plain C: one path, each row alone")
    weight, _ = random_matrix("Q4_K", rows=64, cols=512, seed=13)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(13))
    alone = torch.cat([quantized.matmul(x[i:i + 1], weight, kernel) for i in range(len(x))])
    assert not torch.equal(quantized.matmul(x, weight, kernel), alone)
    assert torch.equal(quantized.matmul(x, weight, kernel.rows_apart()), alone)


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
    torch.testing.assert_close(got.float(), rounded(x.float()) @ reference.T, atol=0.05, rtol=0.02)


def test_kernel_refuses_rows_of_the_wrong_width():
    weight, _ = random_matrix("Q8_0", rows=4, cols=64)
    with pytest.raises(ValueError, match="float32"):
        kernel_for("portable-c").matmul(torch.randn(2, 32), weight.blocks, int(weight.ggml_type), 64)


def test_a_step_buffer_takes_the_product_and_is_reused():
    weight, reference = random_matrix("Q8_0", rows=48, cols=64)
    kernel, buffer = kernel_for("as-built"), StepBuffer()
    x = torch.randn(5, 64)
    alone = quantized.matmul(x, weight, kernel)
    into = quantized.matmul(x, weight, kernel, buffer)
    assert torch.equal(into, alone) and into.data_ptr() == buffer.rows(5, 48).data_ptr()
    again = quantized.matmul(x[:3], weight, kernel, buffer)  # fewer rows: the same memory
    assert again.data_ptr() == into.data_ptr() and torch.equal(again, alone[:3])
    with pytest.raises(ValueError, match="out must be contiguous float32 \\[5, 48\\]"):
        kernel.matmul_checked_blocks(x, weight.blocks, int(weight.ggml_type), 64, out=torch.empty(5, 47))


def test_parts_of_different_types_concatenate():
    first, first_ref = random_matrix("Q4_0", rows=6, cols=256, seed=1)
    second, second_ref = random_matrix("Q4_K", rows=3, cols=256, seed=2)
    third, third_ref = random_matrix("Q4_0", rows=2, cols=256, seed=3)
    parts = quantized.merge_parts([first, third, second, torch.ones(1, 256)])
    assert [p.shape[0] for p in parts] == [8, 3, 1]  # the two Q4_0 shards stacked
    x = torch.randn(2, 256)
    quantized_rows = torch.cat([rounded(x) @ torch.cat([first_ref, third_ref]).T, rounded(x, "Q4_K") @ second_ref.T], dim=1)
    expected = torch.cat([quantized_rows, x @ torch.ones(1, 256).T], dim=1)  # a float part takes x as it is
    torch.testing.assert_close(quantized.linear(x, parts, None, None), expected, atol=1e-4, rtol=1e-5)


def test_unsupported_quant_type_names_itself_and_the_supported_list():
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_down\.weight' has type IQ3_S.*"
                                         r"Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, "
                                         r"IQ4_XS"):
        keeps_quantized("blk.0.ffn_down.weight", GGMLType.IQ3_S, "gguf")
    assert not keeps_quantized("blk.0.ffn_down.weight", GGMLType.IQ3_S, "auto")
    assert keeps_quantized("blk.0.ffn_down.weight", GGMLType.Q6_K, "gguf")
    assert not keeps_quantized("blk.0.ffn_up.weight", GGMLType.Q4_1, "none")
    assert not keeps_quantized("blk.0.attn_norm.weight", GGMLType.F32, "gguf")
    with pytest.raises(ValueError, match="quantization: must be one of auto, gguf, none"):
        keeps_quantized("x", GGMLType.Q4_1, "int4")


# Each file's types (``test_gguf_loading``) and the parts they make once loaded: a
# type with a kernel is kept in blocks, one without is a float part (None).
FILES = {
    "4-bit": (TYPES, {"qkv": [GGMLType.Q4_0, GGMLType.Q8_0, GGMLType.Q4_K], "o": [GGMLType.Q4_1], "gate_up": None,
                      "down": [GGMLType.Q6_K], "lm_head": [GGMLType.Q6_K], "embed": GGMLType.Q8_0}),
    "5-bit": (TYPES_5_BIT, {"qkv": [GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q5_K], "o": [GGMLType.Q2_K],
                            "gate_up": [None, GGMLType.IQ4_NL], "down": [GGMLType.Q3_K],
                            "lm_head": [GGMLType.IQ4_XS], "embed": GGMLType.Q5_0}),
}


@pytest.fixture(scope="module", params=list(FILES))
def mixed_gguf(request, tmp_path_factory):
    """(path, the model of its decoded weights, the parts expected) of a tiny llama GGUF
    whose tensors take the types of ``FILES[request.param]``."""
    types, parts = FILES[request.param]
    path = tmp_path_factory.mktemp("quantized") / "mixed.gguf"
    decoded = write_gguf(path, CONFIG, random_checkpoint(CONFIG), types=types)
    return str(path), direct_model(CONFIG, decoded), parts


@pytest.fixture(scope="module")
def pytorch_logits(mixed_gguf):
    """The kept model's logits through the PyTorch path (blocks dequantized per call)."""
    model, _ = load_gguf_model(*read_gguf(mixed_gguf[0]), quantization="auto")
    model.use_quant_kernel(None)
    return logits(model, IDS)


IDS = list(range(3, 40))


@pytest.mark.parametrize("path", PATHS)
def test_gguf_kept_quantized_gives_the_dequantized_logits(mixed_gguf, pytorch_logits, path):
    file, reference, parts = mixed_gguf
    model, _ = load_gguf_model(*read_gguf(file), quantization="auto")
    model.use_quant_kernel(kernel_for(path))
    layer = model.model.layers[0]
    linears = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
               "down": layer.mlp.down_proj, "lm_head": model.lm_head}
    for name, linear in linears.items():  # None: every shard dequantized, a float weight (or part)
        kept = linear.quantized and [getattr(p, "ggml_type", None) for p in linear.quantized]
        assert kept == parts[name], name
    assert model.model.embed_tokens.quantized.ggml_type == parts["embed"]
    got = logits(model, IDS)
    # Every path rounds the activations alike, but a float32 sum taken in another
    # order can move a value across a rounding boundary: a step of 1/32767 of its
    # group's largest value, which this random model (logits up to ~700) carries
    # to ~2e-5 of the logits' scale (measured 1.7e-5-7.4e-5), or of 1/127 where a
    # part rounds x to bytes (the 4-bit file's Q4_K and Q6_K parts; 258 times the
    # step, measured 6.8e-3) ...
    with_bytes = any(t is not None and t.name in BYTE_KINDS for kept in parts.values() if isinstance(kept, list)
                     for t in kept)
    scale = pytorch_logits.abs().max().item()
    torch.testing.assert_close(got, pytorch_logits, atol=(2e-2 if with_bytes else 1e-4) * scale, rtol=0)
    # ... and the rounding keeps them near the float32 model's (measured 1.5e-4-1.9e-4;
    # with int8 steps, which this random model amplifies, 2.1e-2: on real files the
    # perplexity moves by 0.06%, bench/perplexity.py, BENCHMARKS.md avx2-byte-products-v1).
    expected = logits(reference, IDS)
    assert (got - expected).abs().max().item() < (5e-2 if with_bytes else 5e-4) * scale


def test_a_type_without_a_kernel_is_refused_naming_the_tensor(tmp_path):
    path = tmp_path / "tq2.gguf"
    write_gguf(path, CONFIG, random_checkpoint(CONFIG), types={**TYPES, "ffn_down": GGMLType.TQ2_0})
    with pytest.raises(ValueError, match=r"quantization gguf: GGUF tensor 'blk\.0\.ffn_down\.weight' has type TQ2_0"):
        load_gguf_model(*read_gguf(str(path)), quantization="gguf")
    # auto keeps what it can and dequantizes the rest, and the start-up log says so
    model, _ = load_gguf_model(*read_gguf(str(path)), quantization="auto")
    assert model.model.layers[0].mlp.down_proj.quantized is None
    assert model.model.layers[0].self_attn.o_proj.quantized[0].ggml_type == GGMLType.Q4_1
    assert model.dequantized_at_load == {"TQ2_0": CONFIG.num_hidden_layers}
    log = io.StringIO()
    options = EngineOptions.from_kwargs(device="cpu", dtype="float32", max_model_len=128, num_gpu_blocks=16)
    assemble_engine(options, model, model.config, None, log=log)
    assert "GGUF tensors dequantized to float32 at load (no quantized kernel computes their type): TQ2_0 x2" \
        in log.getvalue()


def test_none_keeps_every_weight_float(mixed_gguf):
    file, reference, _ = mixed_gguf
    model, _ = load_gguf_model(*read_gguf(file), quantization="none")
    assert model.quantized_weights() == []
    ids = list(range(3, 40))
    torch.testing.assert_close(logits(model, ids), logits(reference, ids), atol=1e-5, rtol=1e-5)
