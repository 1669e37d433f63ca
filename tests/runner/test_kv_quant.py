"""The q8_0 KV cache (``cadence.runner.kv_quant``): PyTorch's bytes are the C kernels'
bytes, the values come back within half a step of the scale, and the C attention
kernel over q8_0 blocks equals it over the same values decoded to float32."""

from __future__ import annotations

import pytest
import torch

from cadence.kernels.decoder_stack import decoder_stack
from cadence.kernels.paged_attention import paged_attention
from cadence.runner import kv_quant
from cadence.runner.cpu_paths import choose_cpu_paths
from cadence.runner.kv_cache import PagedKVCache, bytes_per_block, resolve_kv_cache_dtype
from cadence.models.testing import tiny_config


def rows():
    generator = torch.Generator().manual_seed(0)
    random = torch.randn(64, 128, generator=generator) * torch.logspace(-2, 3, 64).unsqueeze(1)
    edges = torch.zeros(3, 128)
    edges[1, :32] = torch.arange(32) - 15.5  # halves: ties round to even
    edges[2, 5] = -7.0  # one value in a block of zeros
    return torch.cat([random, edges])


def test_values_come_back_within_half_a_step_and_the_scale_rounding():
    x = rows()
    data = kv_quant.encode(x)
    assert data.dtype == torch.uint8 and data.shape == (x.shape[0], 128 // 32 * 34)
    back = kv_quant.decode(data, torch.float32)
    groups = x.view(x.shape[0], -1, 32)
    step = groups.abs().amax(-1, keepdim=True) / 127
    error = (back.view_as(groups) - groups).abs()
    # half a step, plus the scale's rounding to float16 (2^-11 relative) times |q| <= 127
    assert (error <= step * (0.5 + 127 * 2.0 ** -11)).all()
    assert torch.equal(kv_quant.decode(kv_quant.encode(torch.zeros(2, 64)), torch.float32), torch.zeros(2, 64))
    # Scales below float16's range (values under ~1e-7) flush to zero, as llama.cpp's do.
    assert torch.equal(kv_quant.decode(kv_quant.encode(torch.full((1, 32), 1e-30)), torch.float32),
                       torch.zeros(1, 32))


def test_the_c_side_writes_the_same_bytes():
    paths = choose_cpu_paths(torch.float32)
    kernel = decoder_stack(paths.decoder_stack_arch) if paths.decoder_stack_arch else None
    if kernel is None:
        pytest.skip("no C compiler here")
    x = torch.cat([rows(), torch.full((1, 128), 1e-30), torch.randn(1, 128) * 1e-6])
    expected = kv_quant.encode(x)
    for row, want in zip(x, expected):
        assert torch.equal(kernel.store_row(row, kv_quant.Q8_0), want)


def test_a_block_holds_1_88_times_the_tokens_of_float16():
    config = tiny_config(head_dim=64)
    assert bytes_per_block(config, 16, torch.float16) / bytes_per_block(config, 16, kv_quant.Q8_0) == 64 / 34
    assert resolve_kv_cache_dtype("q8_0", torch.float32, torch.device("cpu")) == kv_quant.Q8_0
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_cache_dtype("q8_0", torch.float32, torch.device("cuda"))
    with pytest.raises(ValueError, match="head_dim 16"):
        PagedKVCache.for_model(tiny_config(head_dim=16), num_blocks=4, block_size=16, dtype=kv_quant.Q8_0)


def test_the_attention_kernel_reads_q8_0_as_the_decoded_values():
    kernel = paged_attention()
    if kernel is None:
        pytest.skip("no C compiler here")
    generator = torch.Generator().manual_seed(1)
    num_blocks, block_size, kv_heads, heads, head_dim = 12, 4, 2, 4, 64
    cache = PagedKVCache.allocate(num_layers=1, num_blocks=num_blocks, block_size=block_size,
                                  num_kv_heads=kv_heads, head_dim=head_dim, dtype=kv_quant.Q8_0)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:30]
    k, v = (torch.randn(30, kv_heads, head_dim, generator=generator) for _ in range(2))
    cache.write(0, k, v, slots)
    decoded = PagedKVCache(kv_quant.decode(cache.data, torch.float32))
    block_table = torch.arange(num_blocks, dtype=torch.int32).view(1, -1)  # one sequence over every block
    q = torch.randn(3, heads, head_dim, generator=generator)
    outs = []
    for source in (cache, decoded):
        out = torch.zeros_like(q)
        kernel(q, source.keys(0), source.values(0), out, torch.tensor([0]), torch.tensor([3]),
               torch.tensor([num_blocks * block_size]), block_table, None, 0.125)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert kernel.supports(torch.float32, kv_quant.Q8_0)
