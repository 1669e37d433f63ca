"""KV cache groups (``cadence/core/kv_cache/groups.py``, ``hybrid.py``): layers of
one attention type share a block table; a window group frees the blocks
behind its window, the null block standing in for them; prefix hits need
every group's part of the prefix (a window group only its window); no block
leaks, whatever finishes, aborts or is preempted."""

from __future__ import annotations

from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from cadence.core.kv_cache import BlockRemoved, HybridKVCacheManager, KVCacheManager, plan_kv_cache_layout
from cadence.core.kv_cache.hashing import ROOT_HASH
from cadence.core.request import RequestStatus
from cadence.core.testing import (
    FakeRunner, all_blocks_free, flatten, greedy_stream, new_request, new_scheduler,
)
from cadence.engine.dp_router import PrefixIndex
from tests.core.kv_oracle import expected_streams, run_workload, workloads

BS = 4


def test_gemma3_layers_split_into_six_groups_of_three():
    full = (5, 11, 17)
    layout = plan_kv_cache_layout(18, 512, full)
    assert layout.num_groups == 6 and layout.layers_per_group == 3
    assert layout.groups[0].layer_ids == full and layout.groups[0].sliding_window is None
    assert all(g.sliding_window == 512 for g in layout.groups[1:])
    assert sorted(l for g in layout.groups for l in g.layer_ids) == list(range(18))
    slots = layout.layer_slot()
    assert [slots[l] for l in (5, 11, 17, 0, 1, 2)] == [0, 1, 2, 0, 1, 2]


def test_models_without_windows_keep_the_plain_manager():
    assert not plan_kv_cache_layout(12, None, ()).is_hybrid
    scheduler = new_scheduler(kv_cache_layout=plan_kv_cache_layout(4, None, ()))
    assert type(scheduler.kv_cache_manager) is KVCacheManager
    every_layer_windowed = plan_kv_cache_layout(4, 8, ())
    assert every_layer_windowed.num_groups == 1 and every_layer_windowed.is_hybrid


def test_the_longest_request_a_cache_holds_counts_every_group():
    layout = plan_kv_cache_layout(2, 8, (1,))  # full [1]; window 8 [0]
    # 41 blocks, one the null block; the window group holds at most ceil((7 + 16) / 4) + 1 = 7.
    assert layout.max_request_tokens(41, BS, 16) == (40 - 7) * BS
    assert plan_kv_cache_layout(2, 8, ()).max_request_tokens(41, BS, 16) >= 1 << 40  # windows only


def _manager(num_blocks=64, window=8, caching=True):
    return HybridKVCacheManager(num_blocks, BS, 256, sliding_windows=(None, window), enable_caching=caching)


def _advance(kv, request, num_new):
    """allocate_slots then the step's commit, as the scheduler does."""
    assert kv.allocate_slots(request, num_new) is not None
    request.num_computed_tokens += num_new
    kv.check_consistency()


def test_a_window_group_frees_the_blocks_behind_its_window():
    kv = _manager(window=8)
    request = new_request("a", 40, max_tokens=4)
    free_at_start = kv.num_free_blocks
    _advance(kv, request, 40)  # 10 entries per group
    assert kv.num_free_blocks == free_at_start - 20
    _advance(kv, request, 0)  # next query at 40 sees keys 33..: entries 0..7 are behind
    full, window = kv.req_to_blocks["a"]
    assert all(b is not kv.null_block for b in full)
    assert [b is kv.null_block for b in window] == [True] * 8 + [False] * 2
    assert kv.num_free_blocks == free_at_start - 12
    assert kv.num_owned_blocks == [10, 2]
    assert kv.get_block_ids("a")[1][:8] == [0] * 8
    kv.free(request)
    kv.check_consistency()
    assert kv.num_free_blocks == kv.block_pool.num_blocks - 1 and kv.null_block.ref_cnt == 1


def test_a_prefix_hit_needs_only_the_window_in_a_window_group():
    kv = _manager(window=8)
    prompt = list(range(100, 140))
    first = new_request("a", prompt, max_tokens=1)
    _advance(kv, first, 40)
    kv.cache_blocks(first, 40)
    _advance(kv, first, 0)  # window blocks 0..7 freed (cached-free: still hits)
    kv.free(first)
    # Evict the window group's early blocks from the prefix cache: a hit of the
    # whole prompt needs only the blocks under its last window.
    cached = kv.block_pool.cached_blocks
    for i in range(6):
        block = cached.pop((first.block_hashes[i], 1))
        block.block_hash = None
    second = new_request("b", prompt, max_tokens=1)
    hits, num_tokens = kv.get_computed_blocks(second)
    assert num_tokens == 36  # (40 - 1) // 4 blocks: one token is always computed
    assert [b is kv.null_block for b in hits[1]] == [True] * 7 + [False] * 2
    # Losing the last block under the window shortens the hit to before it
    # (where the window's blocks, 6 and 7, are still there).
    block = cached.pop((first.block_hashes[8], 1))
    block.block_hash = None
    hits, num_tokens = kv.get_computed_blocks(second)
    assert num_tokens == 8 * BS and len(hits[0]) == len(hits[1]) == 8
    assert hits[1] == [kv.null_block] * 6 + [cached[(first.block_hashes[i], 1)] for i in (6, 7)]
    # And the block before those: no window of the prefix is left whole.
    block = cached.pop((first.block_hashes[6], 1))
    block.block_hash = None
    assert kv.get_computed_blocks(second)[1] == 0
    hits, num_tokens = kv.get_computed_blocks(second)
    assert kv.allocate_slots(second, 40 - num_tokens, num_tokens, hits) is not None
    kv.check_consistency()
    kv.free(second)
    kv.check_consistency()


def test_kv_cache_events_tell_group_0s_blocks_what_a_router_indexes():
    kv = HybridKVCacheManager(9, BS, 256, sliding_windows=(None, 8), enable_kv_cache_events=True)
    request = new_request("a", list(range(100, 112)), max_tokens=1)
    _advance(kv, request, 12)  # registers its 3 full blocks in both groups
    stored = kv.take_events()
    hashes = request.block_hashes
    assert [e.block_hashes for e in stored] == [[hashes[i]] for i in range(3)]
    assert [e.parent_block_hash for e in stored] == [ROOT_HASH, hashes[0], hashes[1]]
    assert stored[1].token_ids == list(range(104, 108)) and stored[1].block_size == BS
    kv.free(request)
    # Eight usable blocks, six cached-free: a new request of 8 blocks evicts them all
    # (and stores its own); group 1's evictions are not told.
    _advance(kv, new_request("b", list(range(200, 216)), max_tokens=1), 16)
    removed = [e for e in kv.take_events() if isinstance(e, BlockRemoved)]
    assert sorted(e.block_hashes[0] for e in removed) == sorted(hashes[:3])
    index = PrefixIndex(1, BS)
    index.absorb(0, stored)
    assert index.num_held_blocks(0) == 3
    index.absorb(0, removed)
    assert index.num_held_blocks(0) == 0


def test_window_groups_admit_more_long_requests_than_one_full_group():
    """The same pool holds more requests once a window group keeps only its window."""
    hybrid = _manager(num_blocks=201, window=8)
    plain = KVCacheManager(100, BS, 256)  # a block of one group's layers is half as big: 2x blocks
    assert hybrid.max_concurrency(200, 8) > 1.8 * plain.max_concurrency(200, 8)


@st.composite
def group_workloads(draw):
    window = draw(st.sampled_from([1, 3, 5, 8, 13]))
    num_layers, full = draw(st.sampled_from([(2, (1,)), (3, (2,)), (4, (1, 3)), (2, ())]))
    layout = plan_kv_cache_layout(num_layers, window, full)
    shared = draw(st.lists(st.integers(100, 130), max_size=20))
    requests = []
    for i in range(draw(st.integers(1, 8))):
        own = draw(st.lists(st.integers(100, 130), min_size=1, max_size=40))
        requests.append(dict(id=f"r{i}", prompt=(shared if draw(st.booleans()) else []) + own,
                             max_tokens=draw(st.integers(1, 12)), arrival=draw(st.integers(0, 6)),
                             abort=draw(st.none() | st.none() | st.integers(0, 30))))
    longest = max(len(r["prompt"]) + r["max_tokens"] for r in requests)
    num_blocks = (-(-longest // BS) + 1) * layout.num_groups + 1 + draw(st.integers(0, 30))
    return dict(layout=layout, requests=requests, num_blocks=num_blocks,
                budget=draw(st.integers(4, 48)), caching=draw(st.booleans()),
                max_num_seqs=draw(st.integers(1, 6)))


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(group_workloads())
def test_random_workloads_keep_every_group_within_its_window_and_leak_nothing(w):
    note(repr(w))
    layout = w["layout"]
    scheduler = new_scheduler(
        max_num_seqs=w["max_num_seqs"], max_num_batched_tokens=w["budget"], block_size=BS,
        num_gpu_blocks=w["num_blocks"], enable_prefix_caching=w["caching"], kv_cache_layout=layout)
    kv = scheduler.kv_cache_manager
    runner = FakeRunner(block_size=BS, check_kv=True, sliding_windows=layout.sliding_windows)
    pending = sorted(w["requests"], key=lambda r: r["arrival"])
    streams, aborted = {}, set()
    for index in range(3000):
        while pending and pending[0]["arrival"] <= index:
            r = pending.pop(0)
            scheduler.add_request(new_request(r["id"], r["prompt"], max_tokens=r["max_tokens"]))
        for r in w["requests"]:
            if r["abort"] == index and r["id"] in scheduler.requests:
                scheduler.finish_requests(r["id"], RequestStatus.FINISHED_ABORTED)
                aborted.add(r["id"])
        if not pending and not scheduler.has_requests():
            break
        so = scheduler.schedule()
        for out in flatten(scheduler.update_from_output(so, runner.execute(so))):
            streams.setdefault(out.request_id, []).extend(out.new_token_ids)
        kv.check_consistency()
        _check_windows(scheduler, layout, w["budget"])
    else:
        raise AssertionError("requests left")
    assert all_blocks_free(scheduler) and kv.null_block.ref_cnt == 1
    assert kv.num_owned_blocks == [0] * layout.num_groups
    for r in w["requests"]:
        expected = greedy_stream(r["prompt"], r["max_tokens"])
        got = streams.get(r["id"], [])
        assert got == (expected[:len(got)] if r["id"] in aborted else expected), r["id"]


def _check_windows(scheduler, layout, budget: int) -> None:
    """A request's window group holds at most its window and one step's tokens:
    ceil((W - 1 + budget) / block_size) + 1 blocks, however long the request."""
    kv = scheduler.kv_cache_manager
    for request in scheduler.running:
        for blocks, window in zip(kv.req_to_blocks.get(request.request_id, ()), layout.sliding_windows):
            if window is None:
                assert kv.null_block not in blocks
            else:
                held = sum(1 for b in blocks if b is not kv.null_block)
                assert held <= -(-(window - 1 + budget) // BS) + 1, (request.request_id, held)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(workloads().filter(lambda w: w.layout is not None))
def test_the_kv_oracle_covers_window_groups(w):
    """The oracle's mixed workloads (policies, chunking, spec decoding, async
    scheduling, n > 1, grammars, aborts, preemption) with KV cache groups: every
    step reads, per group, what its window shows, and it holds what was written."""
    note(repr(w))
    run = run_workload(w)
    expected_streams(w, run)
