"""The pool of KV-cache blocks: free list, reference counts, prefix-cache index.

Every block is in exactly one of three states:

- owned:       ref_cnt > 0, held by one or more requests (shared prefixes);
- cached-free: ref_cnt == 0 with a block hash, in the free queue and in the
               hash index, so a later request can revive it;
- free:        ref_cnt == 0, no hash, in the free queue.

The free queue is ordered for eviction (LRU): allocation takes from the head;
a freed cached block goes to the tail, a freed block without a hash to the
head (it holds nothing to keep). A cached-free block taken for a new use is
evicted from the hash index at that moment.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from cadence.core.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from cadence.core.kv_cache.hashing import ROOT_HASH


class KVCacheBlock:
    """One block of ``block_size`` token slots in the paged KV cache."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Any = None
        # Links of the doubly linked free queue (None when not in it).
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash!r})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) pop from the head, append and remove.

    A list cannot do this: reviving a cached-free block removes it from the
    middle of the queue.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        # Sentinels, so that linking never has to test for the ends.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free = block  # type: ignore[union-attr]
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free block")
        self.remove(block)  # type: ignore[arg-type]
        return block  # type: ignore[return-value]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """The first ``n`` blocks, unlinked in one pass (``n`` <= the number free)."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot take {n} blocks: {self.num_free_blocks} free")
        blocks = []
        block = self._head.next_free
        for _ in range(n):
            blocks.append(block)
            next_block = block.next_free  # type: ignore[union-attr]
            block.prev_free = block.next_free = None  # type: ignore[union-attr]
            block = next_block
        # Relink the head to the first block left (or the tail).
        self._head.next_free = block
        block.prev_free = self._head  # type: ignore[union-attr]
        self.num_free_blocks -= n
        return blocks  # type: ignore[return-value]

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free  # type: ignore[union-attr]
        block.next_free.prev_free = block.prev_free  # type: ignore[union-attr]
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def extend(self, blocks: list[KVCacheBlock]) -> None:
        """``append`` each of ``blocks``, in order, linked in one pass."""
        last = self._tail.prev_free
        for block in blocks:
            last.next_free = block  # type: ignore[union-attr]
            block.prev_free = last
            last = block
        last.next_free = self._tail  # type: ignore[union-attr]
        self._tail.prev_free = last
        self.num_free_blocks += len(blocks)

    def extendleft(self, blocks: list[KVCacheBlock]) -> None:
        """Put ``blocks`` at the head, in order (the first is taken first)."""
        first = self._head.next_free
        prev = self._head
        for block in blocks:
            prev.next_free = block  # type: ignore[union-attr]
            block.prev_free = prev
            prev = block
        prev.next_free = first
        first.prev_free = prev  # type: ignore[union-attr]
        self.num_free_blocks += len(blocks)

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free  # type: ignore[union-attr]

    def __len__(self) -> int:
        return self.num_free_blocks


class BlockPool:
    """Allocates, shares, frees and caches blocks; records cache events."""

    def __init__(self, num_blocks: int, *, enable_caching: bool, enable_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks: must be >= 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # block hash -> the block holding it (one block per hash).
        self.cached_blocks: dict[Any, KVCacheBlock] = {}
        self.enable_events = enable_events
        self._events: list[KVCacheEvent] = []

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks owned by requests (cached-free blocks count as free)."""
        return 1.0 - self.free_queue.num_free_blocks / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` from the head of the free queue, evicting their hashes."""
        blocks = self.free_queue.popleft_n(num_blocks)
        cached_blocks = self.cached_blocks
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is not None:
                # A cached-free block: evicted from the prefix cache now (a
                # block has a hash only while the index holds it under it).
                block.block_hash = None
                del cached_blocks[block_hash]
                if self.enable_events:
                    self._events.append(BlockRemoved([block_hash]))
            block.ref_cnt = 1
        return blocks

    def get_cached_block(self, block_hash: Any) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def forget(self, block_hash: Any) -> None:
        """Take ``block_hash`` out of the prefix cache; its block stays where it
        is, anonymous (a step that was to write it failed: it holds no such KV)."""
        block = self.cached_blocks.pop(block_hash, None)
        if block is None:
            return
        block.block_hash = None
        if self.enable_events:
            self._events.append(BlockRemoved([block_hash]))

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (reviving free ones)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock],
        block_hashes: list[Any],
        first: int,
        end: int,
        token_ids: list[int],
        block_size: int,
        extra_key: Any,
    ) -> None:
        """Register ``blocks[first:end]`` (full) under their hashes; the first
        holder of a hash wins, an equal block cached before keeps it."""
        cached_blocks = self.cached_blocks
        events = self._events if self.enable_events else None
        for i in range(first, end):
            block, block_hash = blocks[i], block_hashes[i]
            if block.block_hash is not None or cached_blocks.setdefault(block_hash, block) is not block:
                continue  # an equal block is already cached; this one stays anonymous
            block.block_hash = block_hash
            if events is not None:
                parent_hash = block_hashes[i - 1] if i else ROOT_HASH
                block_token_ids = token_ids[i * block_size:(i + 1) * block_size]
                events.append(BlockStored(
                    [block_hash], parent_hash, block_token_ids, len(block_token_ids), extra_key
                ))

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block. Blocks reaching zero with a hash
        (cached-free) go to the queue's tail, to be evicted last; those without
        one hold nothing worth keeping and go to the head, to be reused first
        (so cached blocks live longer, and a light load keeps reusing the same
        few blocks: memory pages never touched stay uncommitted).

        Callers pass a request's blocks tail-first, so that its last blocks
        (the least likely to be shared) are evicted first.
        """
        cached: list[KVCacheBlock] = []
        anonymous: list[KVCacheBlock] = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (anonymous if block.block_hash is None else cached).append(block)
        if cached:
            self.free_queue.extend(cached)
        if anonymous:
            self.free_queue.extendleft(anonymous)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is owned."""
        if self.free_queue.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return True

    def record_event(self, event: KVCacheEvent) -> None:
        """An event its owner made (the hybrid manager registers blocks itself)."""
        if self.enable_events:
            self._events.append(event)

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def check_consistency(self, owners: Callable[[], Iterable[list[KVCacheBlock]]]) -> None:
        """Assert the three-state invariant (for tests): every block is free,
        cached-free or owned, and reference counts equal the owners' references."""
        expected = [0] * self.num_blocks
        for blocks in owners():
            for block in blocks:
                expected[block.block_id] += 1
        in_queue = {block.block_id for block in self.free_queue}
        assert len(in_queue) == self.free_queue.num_free_blocks, "free queue count is wrong"
        for block in self.blocks:
            assert block.ref_cnt == expected[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {expected[block.block_id]} owners"
            )
            assert (block.ref_cnt == 0) == (block.block_id in in_queue), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in free queue: "
                f"{block.block_id in in_queue}"
            )
            if block.block_hash is not None:
                assert self.cached_blocks.get(block.block_hash) is block, "hash index out of sync"
        for block_hash, block in self.cached_blocks.items():
            assert block.block_hash == block_hash, "cached block lost its hash"
