"""Prefix caching: chained block hashes, full blocks only, LRU eviction, reset."""

from tests.core.scheduler_sim import ModelRunnerSim, expected_stream, make_request, make_scheduler, run_to_completion, step
from cadence.core.kv_cache import KVCacheManager
from cadence.core.request import Request
from cadence.sampling_params import SamplingParams


def req(req_id, tokens, **kw):
    return Request(req_id, list(tokens), SamplingParams(max_tokens=kw.pop("max_tokens", 4), ignore_eos=True), **kw)


def test_hit_on_full_blocks_of_a_shared_prefix():
    s = make_scheduler(block_size=4)
    prefix = list(range(100, 110))  # 2 full blocks + 2 tokens
    s.add_request(make_request("a", prefix + [1, 2, 3], max_tokens=5))
    runner = ModelRunnerSim(4)
    step(s, runner)
    s.add_request(make_request("b", prefix + [7, 7, 7, 7, 7], max_tokens=2))
    so, _ = step(s, runner)
    new_b = so.scheduled_new_reqs[0]
    assert new_b.num_computed_tokens == 8  # the two full blocks of the prefix
    assert so.num_scheduled_tokens["b"] == 15 - 8
    assert new_b.block_ids[:2] == s.kv_cache_manager.get_block_ids("a")[:2]
    assert s.requests["b"].num_cached_tokens == 8
    streams = run_to_completion(s, runner)
    assert streams["b"] == expected_stream(prefix + [7] * 5, 2)[1:]


def test_equal_tokens_after_a_different_prefix_never_hit():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    a = req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    kv.allocate_slots(a, 9)
    b = req("b", [0, 0, 0, 0, 5, 6, 7, 8, 9])  # block 2 equal, block 1 differs
    assert kv.get_computed_blocks(b) == ([], 0)
    c = req("c", [1, 2, 3, 4, 0, 0, 0, 0, 9])
    blocks, num = kv.get_computed_blocks(c)
    assert num == 4 and [blk.block_id for blk in blocks] == kv.get_block_ids("a")[:1]


def test_only_full_blocks_are_cached_and_one_token_is_always_computed():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    a = req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    same = req("same", list(range(8)))
    blocks, num = kv.get_computed_blocks(same)
    assert num == 4  # not 8: the last token must be computed to sample
    longer = req("longer", list(range(10)))
    assert kv.get_computed_blocks(longer)[1] == 8
    partial = req("p", list(range(6)))
    kv2 = KVCacheManager(num_blocks=20, block_size=4)
    kv2.allocate_slots(partial, 6)
    assert len(kv2.block_pool.cached_blocks) == 1  # the half-full 2nd block is not cached


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    a_blocks = kv.get_block_ids("a")
    kv.free(a)
    assert kv.num_free_blocks == 4 and len(kv.block_pool.cached_blocks) == 2
    b = req("b", list(range(8)) + [99])
    hits, num = kv.get_computed_blocks(b)
    assert num == 8
    kv.allocate_slots(b, 1, num, hits)
    assert kv.get_block_ids("b")[:2] == a_blocks  # revived, not recomputed
    kv.free(b)
    # Fill the pool with new content: free blocks are evicted head first (LRU).
    c = req("c", list(range(500, 516)))
    kv.allocate_slots(c, 16)
    assert kv.block_pool.cached_blocks.keys().isdisjoint(set(b.block_hashes[:2]))
    kv.free(c)


def test_lru_order_evicts_least_recently_freed_first():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    x = req("x", [1, 2, 3, 4, 5])   # blocks: [1,2] [3,4] + partial
    y = req("y", [7, 8, 9, 9, 5])
    kv.allocate_slots(x, 5)
    kv.allocate_slots(y, 5)
    kv.free(x)  # x freed first: its blocks are older
    kv.free(y)
    # 4 blocks: first the two partial blocks (no hash: nothing to keep), then x's two.
    z = req("z", [40, 41, 42, 43, 44, 45, 46, 47])
    kv.allocate_slots(z, 8)
    assert kv.get_computed_blocks(req("x2", [1, 2, 3, 4, 5]))[1] == 0
    assert kv.get_computed_blocks(req("y2", [7, 8, 9, 9, 5]))[1] == 4


def test_blocks_without_a_hash_are_reused_before_cached_ones():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    x = req("x", [1, 2, 3, 4, 5])  # two full blocks (cached) and a partial one
    kv.allocate_slots(x, 5)
    partial = kv.req_to_blocks["x"][-1].block_id
    kv.free(x)
    y = req("y", [9])
    assert kv.allocate_slots(y, 1) == [partial]
    assert kv.get_computed_blocks(req("x2", [1, 2, 3, 4, 5]))[1] == 4


def test_reset_prefix_cache_refused_while_blocks_in_use():
    s = make_scheduler()
    s.add_request(make_request("a", 12, max_tokens=3))
    runner = ModelRunnerSim(4)
    step(s, runner)
    assert s.reset_prefix_cache() is False
    run_to_completion(s, runner)
    assert len(s.kv_cache_manager.block_pool.cached_blocks) > 0
    assert s.reset_prefix_cache() is True
    assert len(s.kv_cache_manager.block_pool.cached_blocks) == 0
    stats = s.make_stats()
    assert stats.prefix_cache_stats.reset is True


def test_outputs_identical_with_and_without_prefix_caching():
    prefix = list(range(300, 321))
    prompts = {f"r{i}": prefix + list(range(i * 7, i * 7 + i + 1)) for i in range(6)}
    results = []
    for caching in (False, True):
        s = make_scheduler(prefix_caching=caching, max_num_batched_tokens=24)
        for name, prompt in prompts.items():
            s.add_request(make_request(name, prompt, max_tokens=5))
        results.append(run_to_completion(s))
    assert results[0] == results[1]
    for name, prompt in prompts.items():
        assert results[1][name] == expected_stream(prompt, 5)


def test_decoded_tokens_are_cached_too():
    s = make_scheduler(block_size=4)
    s.add_request(make_request("a", [5, 6, 7], max_tokens=6))
    runner = ModelRunnerSim(4)
    streams = run_to_completion(s, runner)
    full = [5, 6, 7] + streams["a"]  # 9 tokens: 2 full blocks, only 8 have KV (last is unfed)
    s.add_request(make_request("b", full[:8] + [1], max_tokens=1))
    so, _ = step(s, runner)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8


def test_prefix_cache_stats_count_queries_and_hits():
    s = make_scheduler()
    s.add_request(make_request("a", list(range(9)), max_tokens=1))
    runner = ModelRunnerSim(4)
    so = s.schedule()
    result = s.update_from_output(so, runner.execute(so))
    first = result[0].scheduler_stats.prefix_cache_stats  # taken with the step's outputs
    assert (first.requests, first.queries, first.hits) == (1, 9, 0)
    s.add_request(make_request("b", list(range(9)), max_tokens=1))
    s.schedule()
    stats = s.make_stats().prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (1, 9, 8)
