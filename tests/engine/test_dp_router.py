"""The data-parallel router (``cadence.engine.dp_router``): pure Python, no engine.

Its prefix index is fed the events a real ``KVCacheManager`` publishes, so
the router and the cache agree on what a block is.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cadence.core.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from cadence.core.testing import new_request
from cadence.core.kv_cache import KVCacheManager
from cadence.engine.dp_router import DPRouter

BLOCK = 4


def stored_events(prompt: list[int], hash_algo: str = "builtin") -> list:
    """The BlockStored events a real cache manager emits when it caches ``prompt``."""
    manager = KVCacheManager(num_blocks=64, block_size=BLOCK, enable_caching=True,
                             enable_kv_cache_events=True, hash_algo=hash_algo)
    request = new_request("r", prompt, max_tokens=1)
    manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, len(prompt)) is not None
    return manager.take_events()


def test_round_robin_cycles_and_skips_dead_replicas():
    router = DPRouter(3, "round_robin")
    assert [router.route(f"r{i}", [1] * 8, 1) for i in range(4)] == [0, 1, 2, 0]
    router.mark_dead(1)
    assert [router.route(f"s{i}", [1] * 8, 1) for i in range(3)] == [2, 0, 2]


def test_least_loaded_counts_prompt_and_output_tokens_until_release():
    router = DPRouter(2, "least_loaded")
    assert router.route("big", [1] * 100, 50) == 0
    assert router.loads == [150, 0]
    assert router.route("small", [1] * 10, 5) == 1
    assert router.route("next", [1] * 10, 5) == 1  # 15 < 150
    router.release("big")
    assert router.loads == [0, 30]
    assert router.route("after", [1] * 10, 5) == 0
    assert router.release("unknown") is None


@pytest.mark.parametrize("hash_algo", ["builtin", "sha256"])
def test_cache_aware_routes_a_shared_prefix_to_the_replica_that_holds_it(hash_algo):
    router = DPRouter(4, "cache_aware", block_size=BLOCK)
    prefix = list(range(100, 112))  # three full blocks
    router.absorb_kv_events(2, stored_events(prefix, hash_algo))
    rank = router.route("a", prefix + [7, 8, 9, 10, 11], 4)
    assert rank == 2
    assert router.routed["a"].num_cached_tokens == 12
    assert router.loads[2] == 5 + 4  # only the uncached tokens count
    # Another prefix goes to an idle replica, not to 2.
    assert router.route("b", list(range(500, 516)), 4) != 2


def test_cache_aware_matches_only_leading_blocks_in_a_row_and_extra_keys():
    router = DPRouter(2, "cache_aware", block_size=BLOCK)
    router.absorb_kv_events(1, stored_events([1, 2, 3, 4, 5, 6, 7, 8]))
    index = router.index
    assert index.num_matched_blocks(index.prompt_hashes([1, 2, 3, 4, 5, 6, 7, 8]), 1) == 2
    assert index.num_matched_blocks(index.prompt_hashes([9, 9, 9, 9, 5, 6, 7, 8]), 1) == 0
    assert index.num_matched_blocks(index.prompt_hashes([1, 2, 3, 4, 5, 6, 7, 8], 3), 1) == 0


def test_removed_and_cleared_blocks_are_forgotten():
    router = DPRouter(2, "cache_aware", block_size=BLOCK)
    events = stored_events(list(range(8)))
    router.absorb_kv_events(0, events)
    router.absorb_kv_events(1, events)
    hashes = router.index.prompt_hashes(list(range(8)))
    router.absorb_kv_events(0, [BlockRemoved(events[1].block_hashes)])
    assert router.index.num_matched_blocks(hashes, 0) == 1
    assert router.index.num_matched_blocks(hashes, 1) == 2
    router.absorb_kv_events(1, [AllBlocksCleared()])
    assert router.index.num_matched_blocks(hashes, 1) == 0
    router.mark_dead(0)
    assert router.index.holders == {}


def test_a_block_whose_parent_is_unknown_is_ignored():
    router = DPRouter(1, "cache_aware", block_size=BLOCK)
    router.absorb_kv_events(0, [BlockStored([123], 999, [1, 2, 3, 4], BLOCK)])
    assert router.index.holders == {}


def test_mark_dead_releases_its_requests_and_no_replica_left_is_none():
    router = DPRouter(2, "least_loaded")
    router.route("a", [1] * 4, 1)
    router.route("b", [1] * 4, 1)
    assert router.mark_dead(0) == ["a"]
    assert router.loads[0] == 0 and router.num_requests[0] == 0
    assert router.route("c", [1] * 4, 1) == 1
    router.mark_dead(1)
    assert router.route("d", [1] * 4, 1) is None


def test_unknown_policy_is_refused_naming_the_option():
    with pytest.raises(ValueError, match="dp_routing"):
        DPRouter(2, "random")


# A request: (prompt family, prompt blocks, output tokens); families share prefixes.
request_strategy = st.tuples(st.integers(0, 3), st.integers(1, 6), st.integers(1, 64))
step_strategy = st.one_of(
    st.tuples(st.just("route"), request_strategy),
    st.tuples(st.just("release"), st.integers(0, 1000)),
    st.tuples(st.just("cache"), st.tuples(st.integers(0, 3), st.integers(0, 3))),
)


@settings(max_examples=150, deadline=None)
@given(num_replicas=st.integers(1, 5), margin=st.integers(0, 300),
       steps=st.lists(step_strategy, max_size=60))
def test_cache_aware_never_exceeds_the_imbalance_bound(num_replicas, margin, steps):
    """Whatever the prefixes cached where, the chosen replica's load before the
    request is at most the least loaded one's plus the margin; loads always
    equal the sum of the requests in flight."""
    router = DPRouter(num_replicas, "cache_aware", block_size=BLOCK, load_margin_tokens=margin)
    in_flight: list[str] = []
    for i, (kind, arg) in enumerate(steps):
        if kind == "route":
            family, num_blocks, num_out = arg
            prompt = [family * 1000 + t for t in range(num_blocks * BLOCK)]
            before = list(router.loads)
            rank = router.route(f"r{i}", prompt, num_out)
            assert before[rank] <= min(before) + margin
            in_flight.append(f"r{i}")
        elif kind == "release" and in_flight:
            router.release(in_flight.pop(arg % len(in_flight)))
        elif kind == "cache":
            family, rank = arg
            router.absorb_kv_events(rank % num_replicas,
                                    stored_events([family * 1000 + t for t in range(12)]))
        expected = [0] * num_replicas
        for req_id in in_flight:
            expected[router.routed[req_id].rank] += router.routed[req_id].num_tokens
        assert router.loads == expected


def test_idle_replicas_take_turns_under_least_loaded_and_cache_aware():
    for policy in ("least_loaded", "cache_aware"):
        router = DPRouter(3, policy, block_size=BLOCK)
        ranks = []
        for i in range(4):
            ranks.append(router.route(f"r{i}", [i + 1] * 8, 1))
            router.release(f"r{i}")
        assert ranks == [0, 1, 2, 0], policy


def test_a_short_shared_prefix_does_not_pull_a_burst_onto_one_replica():
    """A burst whose prompts share only a system prompt of 2 blocks: affinity saves 8
    tokens a request, so once the holder is 8 tokens busier the others serve."""
    router = DPRouter(2, "cache_aware", block_size=BLOCK)
    system = [7] * (2 * BLOCK)
    ranks = [router.route(f"r{i}", system + [100 + i] * 40, 16) for i in range(20)]
    assert ranks.count(0) == ranks.count(1) == 10


def test_a_long_shared_prefix_keeps_its_burst_until_the_saving_is_spent():
    """Replica 0 holds 30 shared blocks (120 tokens) in its cache: it keeps the prompts
    that share them while its extra load stays within the 120 tokens each one saves."""
    router = DPRouter(2, "cache_aware", block_size=BLOCK)
    prefix = [7] * (30 * BLOCK)
    router.absorb_kv_events(0, stored_events(prefix))
    ranks = [router.route(f"r{i}", prefix + [100 + i] * 4, 16) for i in range(8)]
    # Each adds 4 + 16 = 20 uncached tokens to replica 0: extra load 0, 20, ..., 120
    # is within the saving for seven of them; the eighth would make it 140.
    assert ranks == [0] * 7 + [1]
