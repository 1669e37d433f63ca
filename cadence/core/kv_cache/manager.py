"""KV-cache manager: which blocks each request holds, and the prefix cache.

The scheduler asks two questions per request:

- ``get_computed_blocks(request)``: how much of this prompt is already in
  the cache? (full blocks only, and never the whole prompt: at least one
  token is always computed so the request gets logits to sample from);
- ``allocate_slots(request, n, ...)``: give it room for ``n`` more tokens,
  or ``None`` when the pool cannot.

Block ids of a request, positions they cover (block_size 4):

    tokens:  t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9
    blocks:  [  blk 17   ][  blk 3     ][ blk 42 (partial, never cached) ]
"""

from __future__ import annotations

from typing import Any

from cadence.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from cadence.core.kv_cache.events import KVCacheEvent
from cadence.core.kv_cache.hashing import BLOCK_HASH_FNS, extend_block_hashes
from cadence.core.kv_cache.interface import KVCacheManagerBase
from cadence.core.outputs import PrefixCacheStats
from cadence.core.request import Request, RequestStatus


# What allocate_slots returns when it takes no block (most decode steps):
# shared, so never changed (a list per request and step was most of a
# decode step's garbage).
NO_NEW_BLOCKS: list[int] = []


class KVCacheManager(KVCacheManagerBase):
    """Owns the block pool and each request's block list (one group of layers;
    ``HybridKVCacheManager`` keeps one list per group)."""

    num_reserved_blocks = 0  # blocks no request can take (the hybrid manager's null block)

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        max_model_len: int | None = None,
        *,
        enable_caching: bool = True,
        hash_algo: str = "builtin",
        enable_kv_cache_events: bool = False,
        log_stats: bool = False,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(
            num_blocks, enable_caching=enable_caching, enable_events=enable_kv_cache_events
        )
        self._hash_fn = BLOCK_HASH_FNS[hash_algo]
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # req_id -> how many of its leading blocks are registered in the prefix
        # cache (read by the scheduler's commit of each step, see cache_blocks).
        self.num_cached_blocks: dict[str, int] = {}
        self.log_stats = log_stats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None

    # ---- queries -------------------------------------------------------

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def group_usage(self) -> dict[str, float]:
        """Per group of layers (here one, full attention), the fraction of blocks requests own."""
        return {"0:full": self.block_pool.usage}

    def num_blocks_per_request(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        """Blocks one request of ``num_tokens`` tokens holds at most."""
        return -(-num_tokens // self.block_size)

    def max_concurrency(self, num_tokens: int, max_num_batched_tokens: int) -> float:
        """Requests of ``num_tokens`` tokens the pool holds at once."""
        return self.block_pool.num_blocks / self.num_blocks_per_request(num_tokens, max_num_batched_tokens)

    def cut_hits(self, hits: list[KVCacheBlock], num_blocks: int) -> tuple[list[KVCacheBlock], int]:
        """The first ``num_blocks`` of ``get_computed_blocks``'s hits, and their token count."""
        hits = hits[:num_blocks]
        return hits, len(hits) * self.block_size

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of the request's leading full blocks found in the prefix cache.

        Returns the blocks (not yet referenced: ``allocate_slots`` takes them)
        and the number of tokens they cover.
        """
        if not self.enable_caching or request.sampling_params.needs_every_prompt_position:
            return [], 0  # prompt logprobs, mean pooling: every prompt position computed
        # At least one token must be computed to produce logits.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        block_hashes = self._block_hashes(request, max_hit_blocks)
        get_cached = self.block_pool.get_cached_block
        hits: list[KVCacheBlock] = []
        for i in range(max_hit_blocks):
            block = get_cached(block_hashes[i])
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.record(
                request.num_tokens, num_hit_tokens, request.status == RequestStatus.PREEMPTED
            )
        return hits, num_hit_tokens

    def num_cached_prefix_tokens(self, request: Request) -> int:
        """Tokens of the request's leading full blocks in the prefix cache now,
        as ``get_computed_blocks`` would find them: a look-up only (no block
        taken, no stats recorded)."""
        if not self.enable_caching or request.sampling_params.needs_every_prompt_position:
            return 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        if max_hit_blocks <= 0:
            return 0
        get_cached = self.block_pool.get_cached_block
        num = 0
        for block_hash in self._block_hashes(request, max_hit_blocks)[:max_hit_blocks]:
            if get_cached(block_hash) is None:
                break
            num += 1
        return num * self.block_size

    def get_num_common_prefix_blocks(self, request: Request, num_running_requests: int) -> int:
        """Leading blocks of ``request`` shared by every running request (for cascade attention)."""
        num_common = 0
        for block in self.req_to_blocks.get(request.request_id, ()):
            if block.ref_cnt != num_running_requests:
                break
            num_common += 1
        return num_common

    # ---- allocation ----------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_external_computed_tokens: int = 0,
    ) -> list[int] | None:
        """Room for ``num_new_tokens`` (+ lookahead) after the computed ones.

        ``new_computed_blocks`` are prefix-cache hits covering
        ``num_new_computed_tokens`` tokens beyond ``request.num_computed_tokens``;
        ``num_external_computed_tokens`` (the first of the new tokens, loaded by
        a KV connector) changes nothing here: every layer reads every position.
        Returns the ids of the blocks newly taken from the pool (hits not
        included), or ``None`` when the pool cannot supply them, in which
        case nothing changed. The list is the caller's to read, not to change:
        a step that takes no block gets ``NO_NEW_BLOCKS``, one list for all.
        """
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id)
        # Tokens computed once this step has run.
        num_computed = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if (
            blocks is not None
            and not new_computed_blocks
            and num_computed + num_lookahead_tokens <= len(blocks) * self.block_size
        ):
            # The common decode step: the tokens fit the blocks held (15 steps
            # in 16), nothing to take from the pool.
            new_block_ids: list[int] | None = NO_NEW_BLOCKS
        else:
            if blocks is None:
                blocks = self.req_to_blocks[req_id] = []
                self.num_cached_blocks[req_id] = 0
            new_block_ids = self._take_new_blocks(
                blocks, num_computed + num_lookahead_tokens, new_computed_blocks
            )
            if new_block_ids is None:
                return None
        if self.enable_caching and not delay_cache_blocks:
            # Cache the blocks filled up; only tokens whose ids are known can
            # be hashed (not drafts, not async placeholders).
            num_known = request.num_tokens if request.num_tokens < num_computed else num_computed
            if num_known // self.block_size > self.num_cached_blocks[req_id]:
                self.cache_blocks(request, num_known)
        return new_block_ids

    def _take_new_blocks(
        self, blocks: list[KVCacheBlock], num_total: int, new_computed_blocks: list[KVCacheBlock] | None
    ) -> list[int] | None:
        """Append the prefix-cache hits, then blocks from the pool up to
        ``num_total`` slots, to ``blocks``; the new blocks' ids, or None
        (nothing changed) when the pool has too few."""
        if self.max_model_len is not None and num_total > self.max_model_len:
            num_total = self.max_model_len
        num_hits = len(new_computed_blocks) if new_computed_blocks else 0
        num_new_blocks = -(-num_total // self.block_size) - len(blocks) - num_hits
        free_queue = self.block_pool.free_queue

        if new_computed_blocks:
            # Reviving cached-free hits takes them out of the free queue too.
            num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
            if num_new_blocks + num_revived > free_queue.num_free_blocks:
                return None
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
        elif num_new_blocks > free_queue.num_free_blocks:
            return None

        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        return [block.block_id for block in new_blocks]

    def free_behind_window(self, request: Request, num_computed_tokens: int) -> None:
        """Nothing: every layer of this cache reads the whole context (the hybrid
        manager frees a window group's blocks behind its window here)."""

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's full blocks up to ``num_computed_tokens`` in the prefix cache."""
        if not self.enable_caching:
            return
        req_id = request.request_id
        num_full = num_computed_tokens // self.block_size
        num_cached = self.num_cached_blocks.get(req_id, 0)
        if num_full <= num_cached:
            return
        blocks = self.req_to_blocks[req_id]
        if num_full > len(blocks):
            num_full = len(blocks)
        block_hashes = self._block_hashes(request, num_full)
        self.block_pool.cache_full_blocks(
            blocks, block_hashes, num_cached, num_full, request.all_token_ids, self.block_size,
            request.extra_hash_key,
        )
        self.num_cached_blocks[req_id] = num_full

    def block_hashes_of(self, request: Request, num_blocks: int) -> list[Any]:
        """The request's block hashes, covering at least its first ``num_blocks``
        full blocks (computed if needed, with prefix caching off too): a KV tier
        keys blocks by them. The request's own list, not a copy."""
        return self._block_hashes(request, num_blocks)

    def _block_hashes(self, request: Request, num_blocks: int) -> list[Any]:
        hashes = request.block_hashes
        if len(hashes) < num_blocks:
            extend_block_hashes(
                hashes, request.all_token_ids, num_blocks, self.block_size,
                self._hash_fn, self._extra_key(request),
            )
        return hashes

    @staticmethod
    def _extra_key(request: Request) -> Any:
        """What besides tokens shapes the KV of the request's blocks."""
        if not request.mm_positions:
            return request.extra_hash_key
        # Blocks overlapping a multimodal item depend on the item's content, whose
        # placeholder tokens are all equal: fold every item's hash in.
        return (request.extra_hash_key, tuple(request.mm_hashes))

    # ---- release -------------------------------------------------------

    def free(self, request: Request) -> None:
        """Release every block of the request (tail first, for eviction order)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def free_block_hashes(self, request: Request) -> None:
        """Drop the request's hash list once it can never be scheduled again."""
        request.block_hashes = []

    def forget_blocks(self, request: Request, first: int, end: int) -> None:
        """Take the request's full blocks ``first`` to ``end`` (indices) out of the
        prefix cache, whichever block holds each hash now: a step that was to
        write them failed (an equal block another request computed goes too:
        a lost hit, never a wrong one)."""
        if not self.enable_caching:
            return
        end = min(end, request.num_tokens // self.block_size)
        hashes, forget = self._block_hashes(request, end), self.block_pool.forget  # (a freed request's again)
        for i in range(first, end):
            forget(hashes[i])

    def reset_prefix_cache(self) -> bool:
        ok = self.block_pool.reset_prefix_cache()
        if ok and self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return ok

    # ---- fork (parallel sampling) --------------------------------------

    def fork_blocks(self, parent: Request, child: Request, num_blocks: int) -> None:
        """Give ``child`` references to the parent's first ``num_blocks`` (full) blocks."""
        shared = self.req_to_blocks[parent.request_id][:num_blocks]
        self.block_pool.touch(shared)
        self.req_to_blocks[child.request_id] = list(shared)
        self.num_cached_blocks[child.request_id] = min(
            num_blocks, self.num_cached_blocks.get(parent.request_id, 0)
        )
        child.block_hashes = parent.block_hashes[:num_blocks]

    # ---- stats and events ----------------------------------------------

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        if self.prefix_cache_stats is None:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    def check_consistency(self) -> None:
        """Assert block-state invariants (tests call this every step)."""
        self.block_pool.check_consistency(lambda: self.req_to_blocks.values())
