"""Which slot of the host-memory tier holds what: the scheduler's view of a
second, larger KV pool (the worker owns the bytes, ``cadence.runner.kv_transfer``).

Every slot is in exactly one of three states:

- free:    holds nothing, in ``free_slots``;
- cached:  holds a full block under its hash, unpinned, in the LRU order
           (evicted from the front when a slot is needed);
- pinned:  in use by a swapped-out request or by a load planned this step;
           never evicted. A pinned slot may also hold a hash (still found by
           lookups); unpinned, it becomes cached (with a hash) or free.

Each write of a slot gets a fresh tag. A copy order names the slot and its
tag, so the worker can tell a slot written as planned from one whose copy
failed or was never made: a load whose tag does not match is a failed load.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class HostTier:
    """Slots of the tier: hash index, LRU order of evictable slots, pins."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("kv_offload_size: too small for one KV block")
        self.num_slots = num_slots
        self.free_slots: list[int] = []  # slots given back; never-used ones from _num_fresh_taken on
        self._num_fresh_taken = 0
        self.index: dict[Any, int] = {}  # block hash -> slot
        self.slot_hash: dict[int, Any] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached, unpinned; oldest first
        self.pins: dict[int, int] = {}  # slot -> pin count
        self.slot_tag: dict[int, int] = {}  # slot -> tag of its last planned write
        self._next_tag = 1

    @property
    def num_cached(self) -> int:
        return len(self.index)

    def lookup(self, block_hash: Any) -> int | None:
        """The slot holding ``block_hash``, or None."""
        return self.index.get(block_hash)

    def touch(self, slot: int) -> None:
        """Mark a cached slot recently used (last to be evicted)."""
        if slot in self.lru:
            self.lru.move_to_end(slot)

    def allocate(self) -> int | None:
        """A slot to write, pinned: a free one, else the least recently used
        cached one (its hash forgotten); None when every slot is pinned."""
        if self.free_slots:
            slot = self.free_slots.pop()
        elif self._num_fresh_taken < self.num_slots:
            slot = self._num_fresh_taken
            self._num_fresh_taken += 1
        elif self.lru:
            slot, _ = self.lru.popitem(last=False)
            del self.index[self.slot_hash.pop(slot)]
        else:
            return None
        self.pins[slot] = 1
        return slot

    def write(self, slot: int, block_hash: Any = None) -> int:
        """Plan a write of an allocated (pinned) slot; its tag. With a hash the
        slot is found by lookups from now on (its copy precedes any load)."""
        if block_hash is not None and block_hash not in self.index:
            self.index[block_hash] = slot
            self.slot_hash[slot] = block_hash
        tag = self._next_tag
        self._next_tag += 1
        self.slot_tag[slot] = tag
        return tag

    def pin(self, slot: int) -> None:
        count = self.pins.get(slot, 0)
        if count == 0:
            self.lru.pop(slot, None)
        self.pins[slot] = count + 1

    def unpin(self, slot: int) -> None:
        count = self.pins[slot] - 1
        if count:
            self.pins[slot] = count
            return
        del self.pins[slot]
        if slot in self.slot_hash:
            self.lru[slot] = None
        else:
            self.slot_tag.pop(slot, None)
            self.free_slots.append(slot)

    def invalidate(self, slot: int) -> None:
        """Forget what a slot holds (its copy failed); freed once unpinned."""
        block_hash = self.slot_hash.pop(slot, None)
        if block_hash is not None and self.index.get(block_hash) == slot:
            del self.index[block_hash]
        if slot in self.lru:
            del self.lru[slot]
            self.slot_tag.pop(slot, None)
            self.free_slots.append(slot)

    def check_consistency(self) -> None:
        """Assert the three-state invariant (for tests)."""
        free, lru, pinned = set(self.free_slots), set(self.lru), set(self.pins)
        assert len(free) == len(self.free_slots), "a slot is free twice"
        assert all(slot < self._num_fresh_taken for slot in free | lru | pinned), "a fresh slot in use"
        free.update(range(self._num_fresh_taken, self.num_slots))
        assert not (free & lru or free & pinned or lru & pinned), "a slot in two states"
        assert len(free) + len(lru) + len(pinned) == self.num_slots, "a slot was lost"
        assert all(count > 0 for count in self.pins.values())
        for block_hash, slot in self.index.items():
            assert self.slot_hash.get(slot) == block_hash, "hash index out of sync"
        assert all(slot in self.slot_hash for slot in lru), "a cached slot without a hash"
