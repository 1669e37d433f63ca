"""KV cache events: BlockStored for full blocks (hashes chained to their
parents), BlockRemoved on eviction, AllBlocksCleared on a prefix-cache reset."""

import pytest
from tests.core.fakes import FakeRunner, new_request, new_scheduler, prompt_of, run_until_done, step

from cadence.core.kv_cache import AllBlocksCleared, BlockRemoved, BlockStored
from cadence.core.kv_cache.hashing import BLOCK_HASH_FNS, ROOT_HASH


def stored(events):
    return [e for e in events if isinstance(e, BlockStored)]


@pytest.mark.parametrize("algo", ["builtin", "sha256"])
def test_full_blocks_are_stored_with_chained_parent_hashes(algo):
    s = new_scheduler(enable_kv_cache_events=True, prefix_caching_hash_algo=algo)
    prompt = prompt_of("a", 10)
    request = new_request("a", prompt, max_tokens=3)
    s.add_request(request)
    run_until_done(s, FakeRunner())
    events = s.take_kv_events()
    assert all(isinstance(e, BlockStored) for e in events)
    # 10 prompt + 2 computed outputs (the 3rd is never fed back) = 12 tokens: 3 full blocks.
    assert len(events) == 3
    tokens = prompt + request.output_token_ids
    hash_fn = BLOCK_HASH_FNS[algo]
    parent = ROOT_HASH
    for i, event in enumerate(events):
        assert event.token_ids == tokens[4 * i:4 * i + 4]
        assert event.block_size == 4
        assert event.parent_block_hash == parent
        assert event.block_hashes == [hash_fn(parent, tuple(event.token_ids), None)]
        assert event.extra_key is None
        parent = event.block_hashes[0]
    assert s.take_kv_events() == []  # taken


def test_partial_blocks_and_prefix_hits_store_nothing_new():
    s = new_scheduler(enable_kv_cache_events=True)
    prompt = prompt_of("p", 11)
    runner = FakeRunner()
    s.add_request(new_request("a", prompt, max_tokens=1))
    run_until_done(s, runner)
    first = s.take_kv_events()
    assert [e.token_ids for e in first] == [prompt[0:4], prompt[4:8]]
    # Same prompt: both full blocks hit the cache; the third block stays partial.
    s.add_request(new_request("b", prompt, max_tokens=1))
    run_until_done(s, runner)
    assert s.take_kv_events() == []


def test_equal_blocks_computed_twice_are_stored_once():
    s = new_scheduler(enable_kv_cache_events=True, enable_prefix_caching=True)
    prefix = prompt_of("p", 8)
    s.add_request(new_request("a", prefix + [1, 2, 3], max_tokens=1))
    s.add_request(new_request("b", prefix + [4, 5, 6], max_tokens=1))
    run_until_done(s, FakeRunner())
    events = s.take_kv_events()
    assert [e.token_ids for e in events] == [prefix[:4], prefix[4:]]


def test_extra_key_carries_the_lora_adapter():
    s = new_scheduler(enable_kv_cache_events=True, max_loras=1)
    s.add_request(new_request("a", 5, max_tokens=1, lora_id=3))
    run_until_done(s, FakeRunner())
    [event] = s.take_kv_events()
    assert event.extra_key == 3


def test_eviction_reports_block_removed_tail_first():
    s = new_scheduler(enable_kv_cache_events=True, num_gpu_blocks=6)
    runner = FakeRunner()
    s.add_request(new_request("a", 10, max_tokens=3))
    run_until_done(s, runner)
    hashes = [e.block_hashes[0] for e in s.take_kv_events()]
    assert len(hashes) == 3
    # b needs 5 of the 6 blocks: the 2 never used, a's partial block and then a's
    # cached blocks from its tail (freed last-first, so evicted first).
    s.add_request(new_request("b", 20, max_tokens=1))
    so, _ = step(s, runner)
    events = s.take_kv_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [[hashes[2]], [hashes[1]]]
    assert len(stored(events)) == 5
    assert events.index(removed[-1]) < events.index(stored(events)[0])
    # a's first block survived and is still a hit.
    assert s.kv_cache_manager.block_pool.get_cached_block(hashes[0]) is not None


def test_reset_prefix_cache_reports_all_blocks_cleared():
    s = new_scheduler(enable_kv_cache_events=True)
    runner = FakeRunner()
    s.add_request(new_request("a", 9, max_tokens=1))
    run_until_done(s, runner)
    s.take_kv_events()
    assert s.reset_prefix_cache() is True
    s.add_request(new_request("b", 5, max_tokens=1))
    step(s, runner)
    events = s.take_kv_events()
    assert events[0] == AllBlocksCleared()
    assert len(events) == 2 and isinstance(events[1], BlockStored)  # b's first block, after the reset


def test_refused_reset_reports_nothing():
    s = new_scheduler(enable_kv_cache_events=True)
    s.add_request(new_request("a", 9, max_tokens=4))
    step(s, FakeRunner())
    s.take_kv_events()
    assert s.reset_prefix_cache() is False  # a holds blocks
    s.schedule()
    assert not any(isinstance(e, AllBlocksCleared) for e in s.take_kv_events())


def test_no_events_when_disabled():
    s = new_scheduler(num_gpu_blocks=6)
    runner = FakeRunner()
    s.add_request(new_request("a", 10, max_tokens=3))
    run_until_done(s, runner)
    s.add_request(new_request("b", 20, max_tokens=1))
    run_until_done(s, runner)
    s.reset_prefix_cache()
    s.schedule()
    assert s.take_kv_events() == []
    assert s.kv_cache_manager.take_events() == []


def test_reset_is_reported_without_waiting_for_a_step():
    s = new_scheduler(enable_kv_cache_events=True)
    s.add_request(new_request("a", 9, max_tokens=1))
    run_until_done(s, FakeRunner())
    s.take_kv_events()
    assert s.reset_prefix_cache() is True
    assert s.take_kv_events() == [AllBlocksCleared()]
