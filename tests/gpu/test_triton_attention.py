"""The Triton paged-attention kernel against a dense reference, on random mixed steps.

Each step mixes decodes, short queries (speculative verification), plain
prefills and prefill chunks over a cached prefix, in shuffled blocks of a
paged cache; grouped-query heads, sliding windows and float32 / bfloat16 /
float16 are covered.
"""

from __future__ import annotations

import random

import pytest
import torch

from cadence.kernels.triton_attention import TileShape, paged_attention, tiles_of
from tests.gpu.conftest import HAS_CUDA
from tests.runner.test_attention import dense_attention

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def random_step(rng, device, dtype, *, num_seqs, block_size, num_heads, num_kv_heads, head_dim,
                max_prefill):
    """A paged cache holding every sequence's keys, plus the step's queries and tables."""
    num_blocks = 8 + num_seqs * (-(-(40 + max_prefill) // block_size))
    key_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    free = list(range(num_blocks))
    rng.shuffle(free)
    seqs, query_start_loc, seq_lens = [], [0], []
    for _ in range(num_seqs):
        kind = rng.choice(["decode", "short", "prefill", "chunk"])
        num_cached = 0 if kind == "prefill" else rng.randint(1, 40)
        query_len = {"decode": 1, "short": rng.randint(2, 5)}.get(kind, rng.randint(6, max_prefill))
        seq_len = num_cached + query_len
        blocks = [free.pop() for _ in range(-(-seq_len // block_size))]
        keys = torch.randn(seq_len, num_kv_heads, head_dim).to(dtype)
        values = torch.randn(seq_len, num_kv_heads, head_dim).to(dtype)
        for p in range(seq_len):
            key_cache[blocks[p // block_size], p % block_size] = keys[p]
            value_cache[blocks[p // block_size], p % block_size] = values[p]
        seqs.append((num_cached, query_len, keys, values))
        query_start_loc.append(query_start_loc[-1] + query_len)
        seq_lens.append(seq_len)
        block_rows = seqs[-1] + (blocks,)
        seqs[-1] = block_rows
    width = max(len(s[4]) for s in seqs) + 1
    block_table = torch.zeros(num_seqs, width, dtype=torch.int64)
    for i, s in enumerate(seqs):
        block_table[i, : len(s[4])] = torch.tensor(s[4])
    q = torch.randn(query_start_loc[-1], num_heads, head_dim).to(dtype)
    to = lambda t: t.to(device)  # noqa: E731
    return (seqs, to(q), to(key_cache), to(value_cache), to(torch.tensor(query_start_loc)),
            to(torch.tensor(seq_lens)), to(block_table))


def check_step(seed, device, dtype, sliding_window, *, num_seqs, max_prefill, head_dims):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_kv_heads = rng.choice([1, 2])
    group = rng.choice([1, 4, 7])
    dims = dict(block_size=rng.choice([1, 4, 16]), num_heads=num_kv_heads * group,
                num_kv_heads=num_kv_heads, head_dim=rng.choice(head_dims))
    seqs, q, keys, values, starts, lens, table = random_step(
        rng, device, dtype, num_seqs=num_seqs, max_prefill=max_prefill, **dims)
    query_lens = [s[1] for s in seqs]
    shape = TileShape.choose(group, max(query_lens), block_n=rng.choice([16, 32, 64]))
    tile_seq, tile_q_start = tiles_of(query_lens, shape.block_q)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, keys, values, out, starts, lens, table, tile_seq.to(device),
                    tile_q_start.to(device), shape, scale=dims["head_dim"] ** -0.5,
                    sliding_window=sliding_window)
    tol = TOLERANCE[dtype]
    starts = starts.tolist()
    for i, (num_cached, _, k, v, _) in enumerate(seqs):
        rows = slice(starts[i], starts[i + 1])
        expected = dense_attention(q[rows].cpu(), k, v, num_cached, sliding_window)
        torch.testing.assert_close(out[rows].cpu().double(), expected, atol=tol, rtol=tol)


SIZES = dict(num_seqs=8, max_prefill=200, head_dims=[64, 128]) if HAS_CUDA else \
    dict(num_seqs=4, max_prefill=24, head_dims=[16, 64])


@pytest.mark.parametrize("seed", range(8 if HAS_CUDA else 3))
@pytest.mark.parametrize("sliding_window", [None, 7])
def test_float32_matches_dense_reference(seed, sliding_window, device):
    check_step(seed, device, torch.float32, sliding_window, **SIZES)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(4 if HAS_CUDA else 1))
def test_half_precision_matches_dense_reference(dtype, seed, device):
    check_step(100 + seed, device, dtype, rng_window(seed), **SIZES)


def rng_window(seed):
    return None if seed % 2 == 0 else 33


def test_tiles_cover_every_query_once():
    tile_seq, tile_q_start = tiles_of([1, 5, 3, 8], block_q=4)
    assert tile_seq.tolist() == [0, 1, 1, 2, 3, 3]
    assert tile_q_start.tolist() == [0, 0, 4, 0, 0, 4]


def test_tile_shape_folds_the_group_into_rows():
    assert TileShape.choose(group=4, max_query_len=1) == TileShape(block_q=4, block_m=16, block_n=64)
    assert TileShape.choose(group=4, max_query_len=100).block_q == 16
    wide = TileShape.choose(group=32, max_query_len=1)  # multi-query: one token's heads fill the tile
    assert (wide.block_q, wide.block_m) == (1, 32)
    odd = TileShape.choose(group=7, max_query_len=50)
    assert odd.block_q * 7 <= odd.block_m


@pytest.mark.parametrize("num_splits", [2, 4, 16])
@pytest.mark.parametrize("sliding_window", [None, 20])
def test_split_keys_decode_matches_dense_reference(num_splits, sliding_window, device):
    """Flash-decoding: each sequence's keys over several programs, then combined.

    Contexts from 1 key (most splits see nothing) to a few hundred.
    """
    rng = random.Random(num_splits)
    torch.manual_seed(num_splits)
    dtype = torch.float32
    num_kv_heads, group, head_dim, block_size = 2, 4, 64, 16
    key_cache = torch.randn(64, block_size, num_kv_heads, head_dim).to(dtype)
    value_cache = torch.randn_like(key_cache)
    contexts = [1, 3, 70, rng.randint(100, 300)]
    free = list(range(64))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in contexts]
    block_table = torch.zeros(len(contexts), 20, dtype=torch.int64)
    for i, blocks in enumerate(tables):
        block_table[i, : len(blocks)] = torch.tensor(blocks)
    q = torch.randn(len(contexts), num_kv_heads * group, head_dim).to(dtype)
    shape = TileShape(block_q=4, block_m=16, block_n=16, num_splits=num_splits)
    tile_seq, tile_q_start = tiles_of([1] * len(contexts), shape.block_q)
    to = lambda t: t.to(device)  # noqa: E731
    out = torch.full_like(to(q), float("nan"))
    paged_attention(to(q), to(key_cache), to(value_cache), out,
                    to(torch.arange(len(contexts) + 1)), to(torch.tensor(contexts)), to(block_table),
                    to(tile_seq), to(tile_q_start), shape, scale=head_dim ** -0.5,
                    sliding_window=sliding_window)
    out = out.cpu()
    for i, (n, blocks) in enumerate(zip(contexts, tables)):
        keys = torch.stack([key_cache[blocks[p // block_size], p % block_size] for p in range(n)])
        values = torch.stack([value_cache[blocks[p // block_size], p % block_size] for p in range(n)])
        expected = dense_attention(q[i : i + 1], keys, values, n - 1, sliding_window)
        torch.testing.assert_close(out[i : i + 1].double(), expected, atol=1e-4, rtol=1e-4)


def test_small_decode_batches_split_their_keys():
    few = TileShape.choose(4, 1, num_tiles=1, num_kv_heads=8, num_sms=132)
    assert few.num_splits == 16
    many = TileShape.choose(4, 1, num_tiles=256, num_kv_heads=8, num_sms=132)
    assert many.num_splits == 1
    assert TileShape.choose(4, 64, num_tiles=1, num_kv_heads=8, num_sms=132).num_splits == 1
