"""Paged attention against a dense reference on random mixed batches."""

from __future__ import annotations

import random

import pytest
import torch

from cadence.runner import attention
from cadence.runner.attention import AttentionMetadata, PagedAttention
from cadence.runner.kv_cache import PagedKVCache, num_blocks_for_budget
from cadence.kernels.paged_attention import paged_attention


@pytest.fixture(params=["torch", "native"])
def kernel(request):
    """The short-query path under test: PyTorch's (None) or the compiled kernel."""
    if request.param == "torch":
        return None
    compiled = paged_attention()
    if compiled is None:
        pytest.skip("no C compiler: the native kernel is unavailable")
    return compiled


def dense_attention(q, k, v, first_pos, sliding_window=None, softcap=None):
    """q [Q, Hq, D] at positions first_pos.., k/v [L, Hkv, D] for positions 0..L-1."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)  # [L, Hq, D]
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / q.shape[-1] ** 0.5  # [Hq, Q, L]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(first_pos, first_pos + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    visible = k_pos <= q_pos
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)  # [Q, Hq, D]


def make_step(rng, *, num_seqs, block_size, num_blocks, num_heads, num_kv_heads, head_dim, dtype,
              cache_dtype=None, max_cached=40):
    """Random sequences (decodes, short and long chunks with cached prefixes).

    Returns the cache (prefixes already written; of ``cache_dtype``, default
    ``dtype``), the step's flat q/k/v, the metadata inputs and each sequence's
    full keys/values for the reference.
    """
    cache = PagedKVCache.allocate(
        num_layers=1, num_blocks=num_blocks, block_size=block_size,
        num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=cache_dtype or dtype,
    )
    free_blocks = list(range(num_blocks))
    rng.shuffle(free_blocks)
    seqs = []
    for _ in range(num_seqs):
        kind = rng.choice(["decode", "short", "prefill", "prefill_cached"])
        num_cached = 0 if kind == "prefill" else rng.randint(1, max_cached)
        query_len = {"decode": 1, "short": rng.randint(2, 6)}.get(kind, rng.randint(9, 30))
        seq_len = num_cached + query_len
        blocks = [free_blocks.pop() for _ in range(-(-seq_len // block_size))]
        keys = torch.randn(seq_len, num_kv_heads, head_dim).to(dtype)
        values = torch.randn(seq_len, num_kv_heads, head_dim).to(dtype)
        seqs.append((num_cached, query_len, blocks, keys, values))
    return cache, seqs


def slots_of(blocks, positions, block_size):
    return [blocks[p // block_size] * block_size + p % block_size for p in positions]


def run_step(cache, seqs, *, num_heads, head_dim, block_size, dtype, sliding_window=None, kernel=None,
             softcap=None):
    # Cached prefixes are already in the cache.
    for num_cached, _, blocks, keys, values in seqs:
        slots = torch.tensor(slots_of(blocks, range(num_cached), block_size), dtype=torch.long)
        cache.write(0, keys[:num_cached], values[:num_cached], slots)
    query_start_loc, seq_lens, slot_mapping, ks, vs = [0], [], [], [], []
    for num_cached, query_len, blocks, keys, values in seqs:
        seq_len = num_cached + query_len
        query_start_loc.append(query_start_loc[-1] + query_len)
        seq_lens.append(seq_len)
        slot_mapping += slots_of(blocks, range(num_cached, seq_len), block_size)
        ks.append(keys[num_cached:])
        vs.append(values[num_cached:])
    max_blocks = max(len(s[2]) for s in seqs) + 2
    block_table = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    for i, (_, _, blocks, _, _) in enumerate(seqs):
        block_table[i, : len(blocks)] = torch.tensor(blocks)
    metadata = AttentionMetadata.build(
        query_start_loc, seq_lens, block_table,
        torch.tensor(slot_mapping, dtype=torch.long), block_size, sliding_window,
        native_short_queries=kernel is not None,
    )
    q = torch.randn(query_start_loc[-1], num_heads, head_dim).to(dtype)
    out = PagedAttention(cache, metadata, kernel=kernel, softcap=softcap)(0, q, torch.cat(ks), torch.cat(vs))
    return q, out, query_start_loc


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("sliding_window", [None, 7])
def test_matches_dense_reference_float32(seed, sliding_window, kernel):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    block_size = rng.choice([1, 4, 16])
    num_kv_heads = rng.choice([1, 2])
    num_heads = num_kv_heads * rng.choice([1, 3])
    head_dim = rng.choice([8, 64, 128])  # 64 and 128 take the kernel's unrolled paths
    dims = dict(num_heads=num_heads, head_dim=head_dim, block_size=block_size, dtype=torch.float32)
    cache, seqs = make_step(
        rng, num_seqs=rng.randint(1, 6), num_blocks=256, num_kv_heads=num_kv_heads, **dims
    )
    q, out, starts = run_step(cache, seqs, sliding_window=sliding_window, kernel=kernel, **dims)
    for i, (num_cached, query_len, _, keys, values) in enumerate(seqs):
        expected = dense_attention(q[starts[i] : starts[i + 1]], keys, values, num_cached, sliding_window)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(8))
def test_long_contexts_read_in_chunks_match_the_dense_reference(seed, kernel):
    """Contexts of up to 700 cached tokens: the native kernel cuts a sequence's keys
    every 128 positions and merges the pieces; Gemma 3's heads (256 wide, 4 per KV
    head) and SmolLM2's (64, 3 per KV head), a float16 cache, windows that start
    inside a chunk, blocks of 3 (not a power of two) or 16 tokens."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_heads, num_kv_heads, head_dim = rng.choice([(4, 1, 256), (9, 3, 64)])
    dims = dict(num_heads=num_heads, head_dim=head_dim, block_size=rng.choice([3, 16]), dtype=torch.float32)
    window, softcap = rng.choice([None, 100, 512]), rng.choice([None, None, 30.0])
    cache, seqs = make_step(rng, num_seqs=rng.randint(1, 4), num_blocks=1024, num_kv_heads=num_kv_heads,
                            cache_dtype=torch.float16, max_cached=700, **dims)
    q, out, starts = run_step(cache, seqs, sliding_window=window, kernel=kernel, softcap=softcap, **dims)
    for i, (num_cached, _, _, keys, values) in enumerate(seqs):
        expected = dense_attention(q[starts[i] : starts[i + 1]], keys.half(), values.half(), num_cached, window,
                                   softcap)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(10))
def test_long_queries_cut_into_window_pieces_match_the_dense_reference(seed, kernel, monkeypatch):
    """With a sliding window, a long query runs as pieces that each read only its
    window: pieces of 3 or 8 tokens here against windows of 4-20, with and without
    a cached prefix, blocks of 1-16 tokens, soft-capped or not."""
    monkeypatch.setattr(attention, "WINDOW_PIECE_QUERY_LEN", 3 + 5 * (seed % 2))
    rng = random.Random(seed)
    torch.manual_seed(seed)
    dims = dict(num_heads=4, head_dim=rng.choice([8, 64]), block_size=rng.choice([1, 4, 16]),
                dtype=torch.float32)
    window, softcap = rng.choice([4, 7, 20]), rng.choice([None, 2.0])
    cache, seqs = make_step(rng, num_seqs=rng.randint(2, 6), num_blocks=256, num_kv_heads=2, **dims)
    q, out, starts = run_step(cache, seqs, sliding_window=window, kernel=kernel, softcap=softcap, **dims)
    for i, (num_cached, _, _, keys, values) in enumerate(seqs):
        expected = dense_attention(q[starts[i] : starts[i + 1]], keys, values, num_cached, window, softcap)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]].double(), expected, atol=1e-5, rtol=1e-5)


def test_a_window_cuts_a_long_query_into_pieces_that_read_only_their_window():
    """1,000 new tokens after 100 cached, a 128-token window: four pieces of at most
    256 query tokens, each reading at most its own tokens and the 127 before them."""
    block_size, window = 16, 128
    table = torch.arange(80, dtype=torch.int32)[None, :]
    slots = torch.arange(100, 1100)
    pieces = AttentionMetadata.build([0, 1000], [1100], table, slots, block_size, window).prefills
    piece = attention.WINDOW_PIECE_QUERY_LEN
    assert [(p.query_start, p.query_end) for p in pieces] == [(j, min(1000, j + piece)) for j in range(0, 1000, piece)]
    for p in pieces:
        num_queries = p.query_end - p.query_start
        first_key = max(0, 100 + p.query_start - (window - 1))
        assert p.kv_len == 100 + p.query_end - first_key <= num_queries + window - 1
        assert p.block_ids.tolist() == list(range(first_key // block_size, -(-(100 + p.query_end) // block_size)))
        assert p.mask.shape == (num_queries, p.kv_len)
    # No window, or one that covers the whole context: the query stays whole.
    for whole_window in (None, 1100):
        (whole,) = AttentionMetadata.build([0, 1000], [1100], table, slots, block_size, whole_window).prefills
        assert (whole.query_start, whole.query_end, whole.kv_len) == (0, 1000, 1100)


@pytest.mark.parametrize("seed", range(6))
def test_soft_capped_scores_match_the_dense_reference(seed, kernel):
    """Gemma 2's cap * tanh(score / cap) before the softmax, on every path (decodes, short
    and long chunks; the native kernel caps its own scores)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    dims = dict(num_heads=4, head_dim=64, block_size=rng.choice([4, 16]), dtype=torch.float32)
    cache, seqs = make_step(rng, num_seqs=rng.randint(1, 6), num_blocks=256, num_kv_heads=2, **dims)
    q, out, starts = run_step(cache, seqs, kernel=kernel, softcap=2.0, **dims)
    for i, (num_cached, _, _, keys, values) in enumerate(seqs):
        expected = dense_attention(q[starts[i] : starts[i + 1]], keys, values, num_cached, softcap=2.0)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_float32_queries_over_a_half_width_cache(seed, cache_dtype, kernel):
    """Keys and values are rounded to the cache's dtype as written; the result is
    float32 attention over those rounded values, on both paths."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    dims = dict(num_heads=6, head_dim=rng.choice([16, 64]), block_size=rng.choice([4, 16]),
                dtype=torch.float32)
    cache, seqs = make_step(rng, num_seqs=6, num_blocks=256, num_kv_heads=2, cache_dtype=cache_dtype, **dims)
    if kernel is not None:
        assert kernel.supports(torch.float32, cache_dtype)
    window = rng.choice([None, 5])
    q, out, starts = run_step(cache, seqs, sliding_window=window, kernel=kernel, **dims)
    assert out.dtype == torch.float32 and cache.data.dtype == cache_dtype
    for i, (num_cached, _, _, keys, values) in enumerate(seqs):
        rows = out[starts[i] : starts[i + 1]].double()
        query = q[starts[i] : starts[i + 1]]
        rounded = dense_attention(query, keys.to(cache_dtype), values.to(cache_dtype), num_cached, window)
        torch.testing.assert_close(rows, rounded, atol=1e-5, rtol=1e-5)
        # ... and close to attention over the unrounded float32 keys and values.
        assert (rows - dense_attention(query, keys, values, num_cached, window)).abs().max() < 0.1


@pytest.mark.parametrize("march", ["native", "x86-64-v2"])
def test_every_float16_value_is_widened_exactly(march):
    """One cached token seen by one decode: softmax gives it weight 1, so the
    output is its value row, widened. Every float16 bit pattern, through the
    F16C instructions (native, where the CPU has them) and the plain-C path."""
    compiled = paged_attention(march)
    if compiled is None:
        pytest.skip(f"the kernel does not build for -march={march} here")
    head_dim, num_seqs = 1024, 64  # 64 sequences x 1024 values = all 2^16 patterns
    patterns = torch.arange(2**16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    cache = torch.zeros(2, num_seqs, 1, 1, head_dim, dtype=torch.float16)  # keys, values
    cache[1] = patterns.view(num_seqs, 1, 1, head_dim)
    out = torch.empty(num_seqs, 1, head_dim)
    compiled(torch.zeros(num_seqs, 1, head_dim), cache[0], cache[1], out,
             torch.arange(num_seqs), torch.ones(num_seqs, dtype=torch.long), torch.ones(num_seqs, dtype=torch.long),
             torch.arange(num_seqs, dtype=torch.int32).view(num_seqs, 1), None, 1.0)
    expected = patterns.float().view(num_seqs, 1, head_dim)
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("seed", range(4))
def test_matches_dense_reference_bfloat16(seed, kernel):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    dims = dict(num_heads=4, head_dim=rng.choice([16, 64]), block_size=4, dtype=torch.bfloat16)
    cache, seqs = make_step(rng, num_seqs=5, num_blocks=256, num_kv_heads=2, **dims)
    q, out, starts = run_step(cache, seqs, kernel=kernel, **dims)
    assert out.dtype == torch.bfloat16
    for i, (num_cached, _, _, keys, values) in enumerate(seqs):
        expected = dense_attention(q[starts[i] : starts[i + 1]], keys, values, num_cached)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]].double(), expected, atol=3e-2, rtol=3e-2)


def test_reads_blocks_written_by_another_sequence_in_the_same_step(kernel):
    """B's cached prefix lives in a block that A fills in this very step."""
    torch.manual_seed(0)
    block_size, heads, dim = 4, 2, 8
    cache = PagedKVCache.allocate(
        num_layers=1, num_blocks=8, block_size=block_size,
        num_kv_heads=heads, head_dim=dim, dtype=torch.float32,
    )
    keys = torch.randn(12, heads, dim)
    values = torch.randn(12, heads, dim)
    # A: positions 0..9 in blocks [5, 2, 6]; B: same first 4 tokens (block 5
    # "cached"), then its own positions 4..5 in block 3 (as a decode-like
    # short query and as a long one would both read block 5).
    a_slots = slots_of([5, 2, 6], range(10), block_size)
    b_keys = torch.cat([keys[:4], torch.randn(2, heads, dim)])
    b_values = torch.cat([values[:4], torch.randn(2, heads, dim)])
    b_slots = slots_of([5, 3], range(4, 6), block_size)
    block_table = torch.tensor([[5, 2, 6], [5, 3, 0]], dtype=torch.int32)
    metadata = AttentionMetadata.build(
        [0, 10, 12], [10, 6], block_table, torch.tensor(a_slots + b_slots), block_size,
        native_short_queries=kernel is not None,
    )
    q = torch.randn(12, heads, dim)
    out = PagedAttention(cache, metadata, kernel=kernel)(
        0, q, torch.cat([keys[:10], b_keys[4:]]), torch.cat([values[:10], b_values[4:]])
    )
    torch.testing.assert_close(out[:10].double(), dense_attention(q[:10], keys[:10], values[:10], 0))
    torch.testing.assert_close(out[10:].double(), dense_attention(q[10:], b_keys, b_values, 4))


def test_write_scatters_to_slots():
    cache = PagedKVCache.allocate(
        num_layers=2, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=3, dtype=torch.float32
    )
    k = torch.arange(6.0).view(2, 1, 3)
    cache.write(1, k, -k, torch.tensor([5, 0]))
    assert torch.equal(cache.keys(1)[2, 1], k[0])  # slot 5 = block 2, offset 1
    assert torch.equal(cache.values(1)[0, 0], -k[1])
    assert cache.data[0].abs().sum() == 0


def test_num_blocks_for_budget():
    class Config:
        num_hidden_layers, num_key_value_heads, head_dim = 2, 4, 8

    per_block = 2 * 2 * 16 * 4 * 8 * 2  # k+v, layers, block_size, heads, dim, bf16 bytes
    assert num_blocks_for_budget(10 * per_block + 1, Config, 16, torch.bfloat16) == 10
    assert num_blocks_for_budget(per_block - 1, Config, 16, torch.bfloat16) == 0


def test_decodes_of_very_different_lengths_are_grouped(kernel):
    torch.manual_seed(1)
    block_size, heads, kv_heads, dim = 4, 4, 2, 8
    cache = PagedKVCache.allocate(
        num_layers=1, num_blocks=512, block_size=block_size,
        num_kv_heads=kv_heads, head_dim=dim, dtype=torch.float32,
    )
    free_blocks = torch.randperm(512).tolist()
    seqs = []
    for num_cached in [1, 3, 9, 30, 31, 90, 200, 201]:
        blocks = [free_blocks.pop() for _ in range(-(-(num_cached + 1) // block_size))]
        seqs.append((num_cached, 1, blocks, torch.randn(num_cached + 1, kv_heads, dim),
                     torch.randn(num_cached + 1, kv_heads, dim)))
    dims = dict(num_heads=heads, head_dim=dim, block_size=block_size, dtype=torch.float32)
    q, out, starts = run_step(cache, seqs, kernel=kernel, **dims)
    for i, (num_cached, _, _, keys, values) in enumerate(seqs):
        expected = dense_attention(q[starts[i] : starts[i + 1]], keys, values, num_cached)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]].double(), expected, atol=1e-5, rtol=1e-5)
    groups = AttentionMetadata.build(
        starts, [s[0] + 1 for s in seqs], torch.zeros(len(seqs), 60, dtype=torch.int32),
        torch.zeros(len(seqs), dtype=torch.long), block_size,
    ).batched
    assert 1 < len(groups) < len(seqs)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("heads", [(8, 1, 64), (6, 1, 32), (5, 1, 16), (12, 2, 64), (4, 1, 256), (3, 3, 48)])
def test_a_float16_cache_read_in_place_for_any_group_of_heads(seed, heads, kernel):
    """Where the CPU has AVX-512 and the head size is a multiple of 16, a float16
    cache is read in place, four query heads of a KV head at a time (groups of 8,
    6, 5 heads take two passes): every head against the dense reference over the
    rounded keys, with windows, soft caps, multi-token queries and long contexts."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_heads, num_kv_heads, head_dim = heads
    dims = dict(num_heads=num_heads, head_dim=head_dim, block_size=rng.choice([4, 16]), dtype=torch.float32)
    cache, seqs = make_step(rng, num_seqs=rng.randint(1, 5), num_blocks=512, num_kv_heads=num_kv_heads,
                            cache_dtype=torch.float16, max_cached=rng.choice([40, 300]), **dims)
    window, softcap = rng.choice([None, 7, 150]), rng.choice([None, 20.0])
    q, out, starts = run_step(cache, seqs, sliding_window=window, kernel=kernel, softcap=softcap, **dims)
    for i, (num_cached, _, _, keys, values) in enumerate(seqs):
        expected = dense_attention(q[starts[i] : starts[i + 1]], keys.half(), values.half(), num_cached, window,
                                   softcap)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]].double(), expected, atol=1e-5, rtol=1e-5)


def test_an_infinite_value_outside_a_window_weighs_nothing(kernel):
    """A cached value of +inf at a key that one query token's window has left
    (weight 0) while the step's other token still sees it: the first token's
    heads see inf, the second's must stay finite (0 x inf would be NaN), heads
    sharing a pass over the float16 cache included. The native kernel's rule
    (PyTorch's path gives NaN there, as SDPA does)."""
    if kernel is None:
        pytest.skip("the native kernel's rule")
    block_size, heads, head_dim, window = 4, 8, 32, 6
    cache = PagedKVCache.allocate(num_layers=1, num_blocks=8, block_size=block_size, num_kv_heads=1,
                                  head_dim=head_dim, dtype=torch.float16)
    torch.manual_seed(0)
    num_cached = 13  # tokens at 13 (sees keys 8..13) and 14 (sees 9..14): key 8, in group 8..11, is 13's only
    keys, values = torch.randn(num_cached + 2, 1, head_dim), torch.randn(num_cached + 2, 1, head_dim)
    values[8] = float("inf")
    seqs = [(num_cached, 2, [3, 1, 6, 0], keys, values)]
    q, out, _ = run_step(cache, seqs, num_heads=heads, head_dim=head_dim, block_size=block_size,
                         dtype=torch.float32, sliding_window=window, kernel=kernel)
    assert not torch.isfinite(out[0]).all()  # the token that sees the inf
    assert torch.isfinite(out[1]).all()
    visible = values.half().nan_to_num(posinf=0.0)  # (the reference would multiply 0 by it)
    expected = dense_attention(q[1:], keys.half(), visible, num_cached + 1, window)
    torch.testing.assert_close(out[1:].double(), expected, atol=1e-5, rtol=1e-5)
