"""KV-cache manager for layer groups (``groups.py``): one block list per group.

Same interface as ``KVCacheManager``; block ids travel as a tuple of lists,
one per group. Every group's list of a request has the same length (one
entry per ``block_size`` positions), so positions map to entries alike.

A window group drops the blocks its layers can no longer read. The next
query of a request is at position ``num_computed``; it sees keys from
``num_computed - W + 1`` on, so every block wholly before that position is
freed (back to the pool, or to the prefix cache as evictable if hashed)
and its entry becomes the *null block* (block 0: reserved, never written,
never freed; the runner's kernels never read an entry behind the window).

    block_size 4, W 6, num_computed 13: first visible key 8

    positions  0-3    4-7    8-11   12-15
    full       [b1]   [b2]   [b3]   [b4]
    window     [null] [null] [b7]   [b8]

Prefix caching per group: a block's key is its chained hash (group 0) or
(hash, group). A hit of L blocks needs every full group to hold blocks
0..L-1 and every window group the blocks covering the last W-1 tokens
before position L * block_size (vLLM's sliding-window ``find_longest_cache_hit``).
"""

from __future__ import annotations

from typing import Any

from cadence.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from cadence.core.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from cadence.core.kv_cache.groups import blocks_per_request, first_entry_in_window
from cadence.core.kv_cache.hashing import BLOCK_HASH_FNS, ROOT_HASH, extend_block_hashes
from cadence.core.kv_cache.interface import KVCacheManagerBase
from cadence.core.outputs import PrefixCacheStats
from cadence.core.request import Request, RequestStatus

GroupBlocks = tuple[list[KVCacheBlock], ...]
GroupBlockIds = tuple[list[int], ...]


class HybridKVCacheManager(KVCacheManagerBase):
    """Owns the block pool and, per request, one block list per group."""

    num_reserved_blocks = 1  # the null block

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        max_model_len: int | None = None,
        *,
        sliding_windows: tuple[int | None, ...],
        enable_caching: bool = True,
        hash_algo: str = "builtin",
        enable_kv_cache_events: bool = False,
        log_stats: bool = False,
    ) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks: KV cache groups need >= 2 blocks (one is the null block)")
        if any(w is not None and w < 1 for w in sliding_windows):
            raise ValueError("sliding_windows: a window must be >= 1")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.sliding_windows = tuple(sliding_windows)
        self.num_groups = len(sliding_windows)
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_caching,
                                    enable_events=enable_kv_cache_events)
        self.enable_kv_cache_events = enable_kv_cache_events
        self.null_block = self.block_pool.free_queue.popleft()  # block 0
        self.null_block.ref_cnt = 1  # held for ever: never free, never cached
        self._hash_fn = BLOCK_HASH_FNS[hash_algo]
        self.req_to_blocks: dict[str, GroupBlocks] = {}
        # req_id -> leading entries registered in the prefix cache (all groups alike).
        self.num_cached_blocks: dict[str, int] = {}
        # req_id -> leading entries already replaced by the null block (per window W).
        self._num_skipped: dict[str, int] = {}
        # Window groups, and the blocks a hit must hold before its end in each.
        self._window_groups = [g for g, w in enumerate(sliding_windows) if w is not None]
        self._window_of = {g: w for g, w in enumerate(sliding_windows) if w is not None}
        self._full_groups = [g for g, w in enumerate(sliding_windows) if w is None]
        # Blocks owned (ref_cnt > 0) per group, for /metrics.
        self.num_owned_blocks = [0] * self.num_groups
        # allocate_slots' answer when it takes no block: shared, read only.
        self._no_new_blocks: GroupBlockIds = tuple([] for _ in range(self.num_groups))
        self.log_stats = log_stats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None

    # ---- queries -------------------------------------------------------

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks (the null block aside) owned by requests."""
        return 1.0 - self.block_pool.num_free_blocks / (self.block_pool.num_blocks - 1)

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def group_usage(self) -> dict[str, float]:
        """Per group ("0:full", "1:window512", ...), the fraction of the usable blocks
        its requests own (they add up to ``usage``)."""
        usable = self.block_pool.num_blocks - 1
        return {f"{g}:{'full' if w is None else f'window{w}'}": n / usable
                for g, (w, n) in enumerate(zip(self.sliding_windows, self.num_owned_blocks))}

    def get_block_ids(self, request_id: str) -> GroupBlockIds:
        groups = self.req_to_blocks.get(request_id)
        if groups is None:
            return tuple([] for _ in range(self.num_groups))
        return tuple([block.block_id for block in blocks] for blocks in groups)

    def num_blocks_per_request(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        """Blocks one request of ``num_tokens`` tokens holds at most, all groups
        together (``groups.blocks_per_request``)."""
        return blocks_per_request(self.sliding_windows, num_tokens, self.block_size, max_num_batched_tokens)

    def max_concurrency(self, num_tokens: int, max_num_batched_tokens: int) -> float:
        """Requests of ``num_tokens`` tokens the pool holds at once."""
        return (self.block_pool.num_blocks - 1) / self.num_blocks_per_request(num_tokens, max_num_batched_tokens)

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """Longest prefix every group holds (see the module doc); blocks not yet referenced."""
        if not self.enable_caching or request.sampling_params.needs_every_prompt_position:
            return self._no_hits(), 0
        num_hit = self._longest_hit(request)
        num_hit_tokens = num_hit * self.block_size
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.record(
                request.num_tokens, num_hit_tokens, request.status == RequestStatus.PREEMPTED
            )
        return self._hit_blocks(request, num_hit), num_hit_tokens

    def num_cached_prefix_tokens(self, request: Request) -> int:
        """``get_computed_blocks``'s token count, as a look-up only."""
        if not self.enable_caching or request.sampling_params.needs_every_prompt_position:
            return 0
        return self._longest_hit(request) * self.block_size

    def cut_hits(self, hits: GroupBlocks, num_blocks: int) -> tuple[GroupBlocks, int]:
        """The hits of the first ``num_blocks`` entries, and their token count (a window
        group's cut may need blocks before the window the hit kept: none are then used)."""
        num_blocks = min(num_blocks, len(hits[0]))
        cut = tuple(blocks[:num_blocks] for blocks in hits)
        for g in self._window_groups:
            if not self._window_held(cut[g], num_blocks, self._window_of[g]):
                return self._no_hits(), 0
        return cut, num_blocks * self.block_size

    def get_num_common_prefix_blocks(self, request: Request, num_running_requests: int) -> int:
        return 0  # (cascade attention reads one table)

    # ---- prefix hits ---------------------------------------------------

    def _no_hits(self) -> GroupBlocks:
        return tuple([] for _ in range(self.num_groups))

    def _key(self, block_hash: Any, group: int) -> Any:
        return block_hash if group == 0 else (block_hash, group)

    def _longest_hit(self, request: Request) -> int:
        """Leading entries (blocks) of the request every group holds in the prefix cache."""
        max_hit = (request.num_tokens - 1) // self.block_size  # at least one token computed
        if max_hit <= 0:
            return 0
        hashes = self._block_hashes(request, max_hit)
        cached = self.block_pool.cached_blocks
        key = self._key
        for g in self._full_groups:
            n = 0
            while n < max_hit and key(hashes[n], g) in cached:
                n += 1
            max_hit = n
        # Each window group lowers the length to its own longest; repeat until all agree.
        changed = True
        while changed and max_hit > 0:
            changed = False
            for g in self._window_groups:
                n = self._longest_window_hit(hashes, g, max_hit)
                if n < max_hit:
                    max_hit, changed = n, True
        return max_hit

    def _longest_window_hit(self, hashes: list[Any], group: int, max_hit: int) -> int:
        """Largest L <= max_hit whose last ``ceil((W-1)/bs)`` blocks (or all, if fewer) are cached."""
        need = -(-(self._window_of[group] - 1) // self.block_size)
        if need == 0:
            return max_hit
        cached, key = self.block_pool.cached_blocks, self._key
        run = 0
        for i in range(max_hit - 1, -1, -1):
            if key(hashes[i], group) in cached:
                run += 1
                if run >= need:
                    return i + need
            else:
                run = 0
        return run  # a run from position 0, shorter than the window

    def _hit_blocks(self, request: Request, num_hit: int) -> GroupBlocks:
        if num_hit == 0:
            return self._no_hits()
        hashes, cached, null = request.block_hashes, self.block_pool.cached_blocks, self.null_block
        hits = []
        for g, w in enumerate(self.sliding_windows):
            first = 0 if w is None else self._first_needed_block(num_hit * self.block_size, w)
            hits.append([null] * first + [cached[self._key(hashes[i], g)] for i in range(first, num_hit)])
        return tuple(hits)

    def _first_needed_block(self, num_computed: int, window: int) -> int:
        """Entries wholly before the first key the next query (at ``num_computed``) sees."""
        return first_entry_in_window(num_computed, window, self.block_size)

    def _window_held(self, blocks: list[KVCacheBlock], num_blocks: int, window: int) -> bool:
        first = self._first_needed_block(num_blocks * self.block_size, window)
        return all(block is not self.null_block for block in blocks[first:num_blocks])

    # ---- allocation ----------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: GroupBlocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_external_computed_tokens: int = 0,
    ) -> GroupBlockIds | None:
        """Room for ``num_new_tokens`` (+ lookahead) in every group after the
        computed ones; window groups first free what fell behind their window.
        The first ``num_external_computed_tokens`` of the new tokens are loaded
        by a KV connector, not computed: a window group gets no block for an
        entry its window no longer reads at the load's end (the null block
        stands there, as the connector loads nothing into it). The ids newly
        taken per group (the null block's among them), or ``None`` (the pool
        cannot; only blocks behind a window were freed)."""
        req_id = request.request_id
        groups = self.req_to_blocks.get(req_id)
        if groups is None:
            groups = self.req_to_blocks[req_id] = tuple([] for _ in range(self.num_groups))
            self.num_cached_blocks[req_id] = 0
            self._num_skipped[req_id] = 0
        elif self._window_groups:
            self._free_behind_window(req_id, groups, request.num_computed_tokens)
        num_computed = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_total = num_computed + num_lookahead_tokens
        if new_computed_blocks is not None and not new_computed_blocks[0]:
            new_computed_blocks = None  # no hits
        if new_computed_blocks is None and num_total <= len(groups[0]) * self.block_size:
            new_block_ids: GroupBlockIds = self._no_new_blocks  # (shared: never changed)
        else:
            loaded_end = None
            if num_external_computed_tokens > 0:
                loaded_end = request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens
            taken = self._take_new_blocks(groups, num_total, new_computed_blocks, loaded_end)
            if taken is None:
                return None
            new_block_ids = taken
            if self._window_groups and (new_computed_blocks is not None or loaded_end is not None):
                self._num_skipped[req_id] = min(self._num_leading_nulls(groups[g]) for g in self._window_groups)
                if loaded_end is not None:  # hits the window no longer reads at the load's end
                    self._free_behind_window(req_id, groups, loaded_end)
        if self.enable_caching and not delay_cache_blocks:
            num_known = request.num_tokens if request.num_tokens < num_computed else num_computed
            if num_known // self.block_size > self.num_cached_blocks[req_id]:
                self.cache_blocks(request, num_known)
        return new_block_ids

    def _num_leading_nulls(self, blocks: list[KVCacheBlock]) -> int:
        null = self.null_block
        n = 0
        while n < len(blocks) and blocks[n] is null:
            n += 1
        return n

    def free_behind_window(self, request: Request, num_computed_tokens: int) -> None:
        """Free now what no window layer reads once ``num_computed_tokens`` are
        computed: a connector's load jumps the request ahead, and loads into a
        window group only what its window reads at the load's end, so the entries
        before it are never written and must not enter the prefix cache."""
        groups = self.req_to_blocks.get(request.request_id)
        if groups is not None and self._window_groups:
            self._free_behind_window(request.request_id, groups, num_computed_tokens)

    def _free_behind_window(self, req_id: str, groups: GroupBlocks, num_computed: int) -> None:
        """Replace the entries no window layer reads any more by the null block."""
        skipped = self._num_skipped[req_id]
        # All window groups share one window in the layouts planned (groups.py);
        # each is checked against its own all the same.
        target = None
        null = self.null_block
        for g in self._window_groups:
            first = self._first_needed_block(num_computed, self._window_of[g])
            if first <= skipped:
                continue
            blocks = groups[g]
            first = min(first, len(blocks))
            freed = [b for b in blocks[skipped:first] if b is not null]
            blocks[skipped:first] = [null] * (first - skipped)
            if freed:
                self._release(g, reversed(freed))
            target = first if target is None else min(target, first)
        if target is not None:
            self._num_skipped[req_id] = target

    def _take_new_blocks(
        self, groups: GroupBlocks, num_total: int, hits: GroupBlocks | None, loaded_end: int | None = None
    ) -> GroupBlockIds | None:
        """Append the hits, then new entries up to ``num_total`` tokens, to every
        group; with ``loaded_end`` (the end of a connector's load), a window
        group's new entries behind its window there are the null block."""
        if self.max_model_len is not None and num_total > self.max_model_len:
            num_total = self.max_model_len
        num_hits = len(hits[0]) if hits is not None else 0
        num_new = max(0, -(-num_total // self.block_size) - len(groups[0]) - num_hits)
        null = self.null_block
        num_revived = 0
        if hits is not None:
            num_revived = sum(1 for blocks in hits for b in blocks if b.ref_cnt == 0 and b is not null)
        num_nulls = [0] * self.num_groups  # per group, leading new entries left null
        if loaded_end is not None:
            first_new = len(groups[0]) + num_hits
            for g in self._window_groups:
                first_read = self._first_needed_block(loaded_end, self._window_of[g])
                num_nulls[g] = min(num_new, max(0, first_read - first_new))
        if num_new * self.num_groups - sum(num_nulls) + num_revived > self.block_pool.num_free_blocks:
            return None
        if hits is not None:
            for g, blocks in enumerate(hits):
                self._touch(g, [b for b in blocks if b is not null])
                groups[g].extend(blocks)
        if num_new == 0:
            return tuple([] for _ in range(self.num_groups))
        new_ids = []
        for g, num_null in enumerate(num_nulls):
            new_blocks = self.block_pool.get_new_blocks(num_new - num_null)
            self.num_owned_blocks[g] += num_new - num_null
            groups[g].extend([null] * num_null)
            groups[g].extend(new_blocks)
            new_ids.append([null.block_id] * num_null + [b.block_id for b in new_blocks])
        return tuple(new_ids)

    def _touch(self, group: int, blocks: list[KVCacheBlock]) -> None:
        before = self.block_pool.num_free_blocks
        self.block_pool.touch(blocks)
        self.num_owned_blocks[group] += before - self.block_pool.num_free_blocks

    def _release(self, group: int, blocks) -> None:
        before = self.block_pool.num_free_blocks
        self.block_pool.free_blocks(blocks)
        self.num_owned_blocks[group] -= self.block_pool.num_free_blocks - before

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks up to ``num_computed_tokens`` in
        the prefix cache, in every group (entries already nulled are skipped)."""
        if not self.enable_caching:
            return
        req_id = request.request_id
        groups = self.req_to_blocks[req_id]
        num_full = min(num_computed_tokens // self.block_size, len(groups[0]))
        first = self.num_cached_blocks.get(req_id, 0)
        if num_full <= first:
            return
        hashes = self._block_hashes(request, num_full)
        cached, null, key = self.block_pool.cached_blocks, self.null_block, self._key
        record = self.block_pool.record_event if self.enable_kv_cache_events else None
        for g, blocks in enumerate(groups):
            for i in range(first, num_full):
                block = blocks[i]
                if block is null or block.block_hash is not None:
                    continue
                block_key = key(hashes[i], g)
                if cached.setdefault(block_key, block) is not block:
                    continue  # an equal block is cached; this one stays anonymous
                block.block_hash = block_key
                if record is not None and g == 0:
                    record(self._stored_event(request, hashes, i))
        self.num_cached_blocks[req_id] = num_full

    def _stored_event(self, request: Request, hashes: list[Any], index: int) -> BlockStored:
        """Block ``index`` of group 0 entered the prefix cache."""
        size = self.block_size
        token_ids = request.all_token_ids[index * size:(index + 1) * size]
        parent = hashes[index - 1] if index else ROOT_HASH
        return BlockStored([hashes[index]], parent, token_ids, len(token_ids), request.extra_hash_key)

    def block_hashes_of(self, request: Request, num_blocks: int) -> list[Any]:
        return self._block_hashes(request, num_blocks)

    def _block_hashes(self, request: Request, num_blocks: int) -> list[Any]:
        hashes = request.block_hashes
        if len(hashes) < num_blocks:
            extra = request.extra_hash_key if not request.mm_positions else (
                request.extra_hash_key, tuple(request.mm_hashes))
            extend_block_hashes(hashes, request.all_token_ids, num_blocks, self.block_size,
                                self._hash_fn, extra)
        return hashes

    # ---- release -------------------------------------------------------

    def free(self, request: Request) -> None:
        """Release every block of the request, in every group (tail first)."""
        groups = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self._num_skipped.pop(request.request_id, None)
        if groups:
            null = self.null_block
            for g, blocks in enumerate(groups):
                self._release(g, [b for b in reversed(blocks) if b is not null])

    def free_block_hashes(self, request: Request) -> None:
        request.block_hashes = []

    def forget_blocks(self, request: Request, first: int, end: int) -> None:
        """``KVCacheManager.forget_blocks``, in every group."""
        if not self.enable_caching:
            return
        end = min(end, request.num_tokens // self.block_size)
        hashes, forget, key = self._block_hashes(request, end), self.block_pool.forget, self._key
        for i in range(first, end):
            for g in range(self.num_groups):
                forget(key(hashes[i], g))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any request holds a block."""
        pool = self.block_pool
        if pool.num_free_blocks != pool.num_blocks - 1:
            return False
        for block in pool.cached_blocks.values():
            block.block_hash = None
        pool.cached_blocks.clear()
        pool.record_event(AllBlocksCleared())
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    # ---- fork (parallel sampling) --------------------------------------

    def fork_blocks(self, parent: Request, child: Request, num_blocks: int) -> None:
        """Give ``child`` references to the parent's first ``num_blocks`` entries of every group."""
        null = self.null_block
        shared = tuple(list(blocks[:num_blocks]) for blocks in self.req_to_blocks[parent.request_id])
        for g, blocks in enumerate(shared):
            self._touch(g, [b for b in blocks if b is not null])
        self.req_to_blocks[child.request_id] = shared
        self.num_cached_blocks[child.request_id] = min(
            num_blocks, self.num_cached_blocks.get(parent.request_id, 0))
        self._num_skipped[child.request_id] = min(num_blocks, self._num_skipped.get(parent.request_id, 0))
        child.block_hashes = parent.block_hashes[:num_blocks]

    # ---- stats and events ----------------------------------------------

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        if self.prefix_cache_stats is None:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def take_events(self) -> list[KVCacheEvent]:
        """The events of group 0's blocks since the last call: the full-attention
        layers (when the model has any), which a prefix hit needs whole, are what
        a router indexes. Evictions of other groups' blocks (keyed ``(hash, group)``;
        a hash is an int or bytes) are left out, as their stores are."""
        return [event for event in self.block_pool.take_events()
                if not (isinstance(event, BlockRemoved) and isinstance(event.block_hashes[0], tuple))]

    def check_consistency(self) -> None:
        """Assert block-state invariants (tests call this every step): the
        pool's three states, the null block held and hashless, every group's
        list of a request equally long, and per-group owned counts."""
        null = self.null_block
        assert null.ref_cnt == 1 and null.block_hash is None, f"null block changed: {null!r}"

        def owners():
            yield [null]
            for groups in self.req_to_blocks.values():
                for blocks in groups:
                    yield [b for b in blocks if b is not null]

        self.block_pool.check_consistency(owners)
        owned: list[set[int]] = [set() for _ in range(self.num_groups)]
        for req_id, groups in self.req_to_blocks.items():
            assert len({len(blocks) for blocks in groups}) == 1, f"{req_id}: group lists differ in length"
            skipped = self._num_skipped[req_id]
            for g, blocks in enumerate(groups):
                owned[g].update(b.block_id for b in blocks if b is not null)
                if self.sliding_windows[g] is not None:
                    assert all(b is null for b in blocks[:skipped]), f"{req_id}: a skipped entry holds a block"
                else:
                    assert null not in blocks, f"{req_id}: a full group holds the null block"
        assert [len(s) for s in owned] == self.num_owned_blocks, (
            f"owned per group {[len(s) for s in owned]} != counted {self.num_owned_blocks}")
