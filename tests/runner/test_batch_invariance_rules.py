"""The batch-invariant mode's parts: what ``batch_invariant`` resolves to and why,
the rows each kind of product needs, padded steps, and attention that does
not depend on how a prompt was chunked (``cadence.runner.batch_invariance``)."""

from __future__ import annotations

import io

import pytest
import torch

from cadence import cpu_features
from cadence.config import EngineOptions
from cadence.kernels.paged_attention import paged_attention
from cadence.models.row_padding import pad_rows_product
from cadence.models.testing import random_model, tiny_config
from cadence.runner.attention import AttentionMetadata, PagedAttention
from cadence.runner.batch_invariance import (
    MKL_FLOAT32_ROWS, ONEDNN_ROWS, BatchInvariance, ForwardInputs, pad_step, product_min_rows,
    resolve_batch_invariance,
)
from cadence.runner.kv_cache import PagedKVCache

CPU = torch.device("cpu")
NATIVE = cpu_features.detect()


def resolve(option, model=None, *, device=CPU, dtype=torch.float32, attention_kernel=True, **kwargs):
    model = random_model(tiny_config(), dtype) if model is None else model
    return resolve_batch_invariance(option, model, device=device, dtype=dtype,
                                    attention_kernel=attention_kernel, **kwargs)


def test_off_is_off_and_on_is_on():
    assert not resolve("off").enabled and resolve("off").reason == "by request"
    on = resolve("on")
    assert on.enabled and on.reason == "by request"


@pytest.mark.parametrize("blocker, kwargs", [
    ("on cuda", dict(device=torch.device("cuda"))),
    ("a mixture-of-experts model", dict(num_experts=4)),
    ("attention would run on PyTorch's SDPA", dict(attention_kernel=False)),
    ("bfloat16 is computed in software",
     dict(dtype=torch.bfloat16, features=cpu_features.with_hidden(NATIVE, "bf16"))),
])
def test_on_is_refused_where_no_invariant_path_exists_and_auto_is_off(blocker, kwargs):
    with pytest.raises(ValueError, match=rf"^batch_invariant: on has no batch-invariant path here: {blocker}"):
        resolve("on", **kwargs)
    auto = resolve("auto", **kwargs)
    assert not auto.enabled and auto.reason.startswith(blocker)


def test_auto_is_on_for_dense_float_weights():
    auto = resolve("auto")
    assert auto.enabled and auto.reason.startswith("auto: dense float weights")


def test_product_floors_follow_the_library_that_computes_them():
    """float32 on MKL needs 16 rows; oneDNN (packed weights, bfloat16) 2."""
    model = random_model(tiny_config())
    assert product_min_rows(model, torch.float32) == (MKL_FLOAT32_ROWS, False, True)
    if model.pack_weights():
        assert product_min_rows(model, torch.float32) == (ONEDNN_ROWS, False, True)
    bf16 = random_model(tiny_config(), torch.bfloat16)
    assert product_min_rows(bf16, torch.bfloat16) == (ONEDNN_ROWS, False, True)
    if NATIVE.native_bf16:  # (emulated bfloat16 has no invariant path: refused, tested below)
        assert resolve("on", bf16, dtype=torch.bfloat16, lora=True).lora_min_rows == ONEDNN_ROWS
    assert resolve("on", lora=True).lora_min_rows == MKL_FLOAT32_ROWS
    assert resolve("on").lora_min_rows == 1  # no LoRA, nothing to pad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_products_give_every_row_its_value_in_any_larger_product(dtype):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(256, 576, generator=generator).to(dtype)
    x = torch.randn(100, 576, generator=generator).to(dtype)
    rows = MKL_FLOAT32_ROWS if dtype == torch.float32 else ONEDNN_ROWS
    product = lambda rows_: rows_ @ weight.T  # noqa: E731
    whole = product(x)
    for start, count in ((0, 1), (1, 2), (7, 3), (20, 5), (33, 11), (50, 16), (60, 40)):
        assert torch.equal(pad_rows_product(product, x[start:start + count], rows), whole[start:start + count])


def test_pad_step_repeats_the_last_token_as_sequences_of_their_own():
    """A padding row computes the key and value its original computes, into the same slot."""
    inputs = ForwardInputs(torch.tensor([5, 6, 7]), torch.tensor([0, 1, 9]), torch.tensor([32, 33, 70]),
                           [0, 2, 3], [2, 10], torch.tensor([[2, 0], [4, 3]], dtype=torch.int32))
    padded = pad_step(inputs, 5)
    assert padded.num_padding == 2
    assert padded.input_ids.tolist() == [5, 6, 7, 7, 7] and padded.positions.tolist() == [0, 1, 9, 9, 9]
    assert padded.slot_mapping.tolist() == [32, 33, 70, 70, 70]
    assert padded.query_start_loc == [0, 2, 3, 4, 5] and padded.seq_lens == [2, 10, 10, 10]
    assert padded.block_table.tolist() == [[2, 0], [4, 3], [4, 3], [4, 3]]
    assert pad_step(inputs, 3) is inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length, window", [(70, None), (300, None), (300, 150)])
def test_attention_of_a_row_does_not_depend_on_the_chunking(dtype, length, window):
    """Long queries on the C kernel, in pieces: row p of a prompt prefilled in one chunk,
    in two chunks, or decoded one token at a time, is the same to the bit; past 128
    tokens the kernel cuts the keys in chunks of its own (at fixed positions), and a
    window starts the keys at another position in every piece."""
    kernel = paged_attention()
    if kernel is None:
        pytest.skip("no C compiler: the native kernel is unavailable")
    block_size, heads, kv_heads, dim = 16, 4, 2, 32
    num_blocks = -(-length // block_size)
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(length, h, dim, generator=generator).to(dtype) for h in (heads, kv_heads, kv_heads))
    table = torch.randperm(num_blocks, generator=generator).to(torch.int32)[None, :]
    slots = torch.tensor([int(table[0, p // block_size]) * block_size + p % block_size for p in range(length)])

    def attend(chunks):
        cache = PagedKVCache.allocate(num_layers=1, num_blocks=num_blocks, block_size=block_size,
                                      num_kv_heads=kv_heads, head_dim=dim, dtype=dtype)
        out, start = [], 0
        for size in chunks:
            rows = slice(start, start + size)
            metadata = AttentionMetadata.build([0, size], [start + size], table, slots[rows], block_size, window,
                                               native_short_queries=True, native_long_queries=True)
            out.append(PagedAttention(cache, metadata, kernel=kernel)(0, q[rows], k[rows], v[rows]))
            start += size
        return torch.cat(out)

    whole = attend([length])
    assert torch.equal(attend([9, length - 9]), whole)
    assert torch.equal(attend([length - 61, 61]), whole)
    assert torch.equal(attend([1] * length), whole)


@pytest.mark.skipif(paged_attention() is None, reason="no C compiler: the mode is off (no C attention)")
def test_the_description_names_what_the_mode_changes():
    rows_apart = BatchInvariance(True, "by request", quant_rows_apart=True)
    assert rows_apart.describe() == (
        "batch-invariant mode on (by request): products on GGUF blocks in integers at every number of "
        "rows, attention one query row at a time on the C kernel")
    padded = BatchInvariance(True, "auto", min_rows=16, lora_min_rows=16)
    assert padded.describe() == (
        "batch-invariant mode on (auto): products on at least 16 rows (short steps padded), each "
        "adapter's rows padded to 16, attention one query row at a time on the C kernel")


def test_start_up_log_says_whether_the_mode_is_on_and_why(tmp_path):
    from cadence.engine.builder import build_engine
    from cadence.models.testing import write_hf_folder

    write_hf_folder(str(tmp_path), random_model(tiny_config(vocab_size=256)))
    for option, said in (("off", "batch-invariant mode off (by request)"),
                         ("auto", "batch-invariant mode on (auto: dense float weights")):
        log = io.StringIO()
        build_engine(EngineOptions.from_kwargs(model=str(tmp_path), dtype="float32", batch_invariant=option,
                                               num_gpu_blocks=16, max_model_len=64), log=log)
        assert f"cadence: {said}" in log.getvalue()
