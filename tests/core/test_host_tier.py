"""The host-memory tier's slot bookkeeping: LRU eviction, pins, tags, and
the swap-or-recompute cost rule."""

import pytest

from cadence.core.kv_transfer.host_tier import HostTier
from cadence.core.kv_transfer.offloading import swap_is_cheaper, tier_num_slots
from cadence.core.sched.kv_connector import KVConnectorContext


def cache(tier: HostTier, block_hash) -> int:
    """Write ``block_hash`` to a fresh slot and release it (as a step's save does)."""
    slot = tier.allocate()
    tier.write(slot, block_hash)
    tier.unpin(slot)
    return slot


def test_the_least_recently_used_block_is_evicted_first():
    tier = HostTier(3)
    slots = {h: cache(tier, h) for h in "abc"}
    tier.touch(tier.lookup("a"))  # a is now the most recent: b goes first
    assert cache(tier, "d") == slots["b"]
    assert tier.lookup("b") is None and tier.lookup("a") == slots["a"]
    assert cache(tier, "e") == slots["c"]
    assert tier.num_cached == 3
    tier.check_consistency()


def test_pinned_slots_are_never_evicted():
    tier = HostTier(2)
    a, b = cache(tier, "a"), cache(tier, "b")
    tier.pin(a)
    tier.pin(b)
    assert tier.allocate() is None  # every slot pinned
    tier.unpin(b)
    assert tier.allocate() == b and tier.lookup("b") is None
    assert tier.lookup("a") == a  # a pinned slot is still found
    tier.unpin(a)
    tier.check_consistency()


def test_a_slot_without_a_hash_is_freed_when_unpinned():
    tier = HostTier(2)
    slot = tier.allocate()
    tier.write(slot)  # a swapped partial block: no hash
    tier.unpin(slot)
    assert slot in tier.free_slots and tier.num_cached == 0
    tier.check_consistency()


def test_every_write_gets_a_new_tag_and_an_equal_hash_keeps_its_first_slot():
    tier = HostTier(4)
    first, second = tier.allocate(), tier.allocate()
    tag1, tag2 = tier.write(first, "h"), tier.write(second, "h")
    assert tag1 != tag2
    assert tier.lookup("h") == first
    tier.unpin(second)  # the copy holding no indexed hash goes back to the free slots
    assert second in tier.free_slots
    tier.unpin(first)
    tier.check_consistency()


def test_invalidated_slots_are_forgotten():
    tier = HostTier(2)
    a = cache(tier, "a")
    tier.invalidate(a)
    assert tier.lookup("a") is None and a in tier.free_slots
    b = tier.allocate()
    tier.write(b, "b")
    tier.invalidate(b)  # pinned: freed when the pin goes
    assert tier.lookup("b") is None and b not in tier.free_slots
    tier.unpin(b)
    assert b in tier.free_slots
    tier.check_consistency()


def test_tier_size_and_a_tier_too_small():
    assert tier_num_slots(1.0, 2**20) == 1024
    with pytest.raises(ValueError, match=r"^kv_offload_size: too small"):
        HostTier(tier_num_slots(1e-9, 2**20))


def test_swap_when_copying_out_and_back_costs_less_than_recomputing():
    gpu = KVConnectorContext(block_size=16, num_blocks=100, bytes_per_block=2**20,
                             seconds_per_token=1e-6, copy_bytes_per_second=2.5e10)
    # 16 tokens recompute in 16 us; a 1 MiB block out and back over 25 GB/s takes 84 us.
    assert not swap_is_cheaper(16, 1, gpu)
    cpu = KVConnectorContext(block_size=16, num_blocks=100, bytes_per_block=2**20,
                             seconds_per_token=5e-3, copy_bytes_per_second=1e10)
    assert swap_is_cheaper(16, 1, cpu)
    assert swap_is_cheaper(16, 0, gpu)  # held by the tier already: nothing to copy
    assert not swap_is_cheaper(16, 1, KVConnectorContext(16, 100, 2**20, seconds_per_token=1.0))
