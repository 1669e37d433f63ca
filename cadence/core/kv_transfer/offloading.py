"""The offloading connector, scheduler side: a host-memory KV tier behind the
prefix cache, and swap preemption.

- Saves (write-through): every full block a step computes is copied, after
  the forward, to a tier slot keyed by the block's hash, unless the tier
  already holds that hash. The tier evicts its least recently used blocks.
  With prefix caching off there are no saves and no tier hits: the tier
  holds swapped requests' own KV only.
- Tier hits: a prompt's blocks beyond the local prefix hits that the tier
  holds are loaded instead of computed. The load is asynchronous for the
  scheduler (the request waits in WAITING_FOR_REMOTE_KVS, usually one step),
  so a failed load comes back as invalid blocks and is recomputed.
- Swap: a preemption victim's KV (its partial last block too) is copied to
  pinned slots before its blocks are reused, and loaded back, like a tier hit,
  when the request is admitted again. Per victim the cost model picks swap or
  recompute (``preemption_mode`` auto), or the mode forces one.

KV cache groups (``cadence.core.kv_cache.groups``): a block of the cache is
one group's page, and so is a tier slot; a slot is keyed by the block's hash
and its group, as the prefix cache keys them. A window group's entries behind
its window hold the null block: nothing is saved or swapped out for them, and
a tier hit (or a swap coming back) loads, in a window group, only the entries
its window reads at the end of the load.

Copy orders reach the worker in ``OffloadingMetadata``; the worker executes
each step's orders in step order (swap-outs, then loads, before the forward;
saves after it), so a slot written by one step is in place for any later
step, and a slot this step reads is pinned until its orders are issued.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cadence.core.kv_cache.groups import as_groups, first_entry_in_window
from cadence.core.kv_transfer.host_tier import HostTier
from cadence.core.outputs import PrefixCacheStats
from cadence.core.sched.kv_connector import KVConnectorBase, KVConnectorContext

if TYPE_CHECKING:
    from cadence.core.kv_cache import Blocks
    from cadence.config import KVTransferConfig
    from cadence.core.kv_cache import AnyKVCacheManager
    from cadence.core.outputs import KVConnectorOutput
    from cadence.core.request import Request
    from cadence.core.sched.output import SchedulerOutput

# A copy order: (KV-cache block id, tier slot, the slot's tag).
CopyOrder = tuple[int, int, int]


@dataclass
class OffloadingMetadata:
    """One step's copy orders, executed in this order by the worker."""

    swap_outs: list[CopyOrder] = field(default_factory=list)  # block -> slot, before loads
    loads: dict[str, list[CopyOrder]] = field(default_factory=dict)  # slot -> block, per request
    saves: list[CopyOrder] = field(default_factory=list)  # block -> slot, after the forward


# Per KV cache group, one entry per block position: a tier slot, or None
# (a window group's entry behind its window: nothing to copy).
GroupSlots = tuple[list[int | None], ...]


@dataclass
class SwappedKV:
    """A preempted request's KV in the tier: per group, one pinned slot per
    block position (None behind a window)."""

    num_tokens: int
    slots: GroupSlots

    def pinned(self) -> list[int]:
        return [slot for group in self.slots for slot in group if slot is not None]


def tier_num_slots(offload_gib: float, bytes_per_block: int) -> int:
    """Blocks of ``bytes_per_block`` that ``offload_gib`` GiB hold."""
    return int(offload_gib * 2**30) // bytes_per_block


def swap_is_cheaper(num_copy_tokens: int, num_copy_blocks: int, context: KVConnectorContext) -> bool:
    """Whether copying ``num_copy_blocks`` out and back in is predicted to
    take less time than computing ``num_copy_tokens`` again."""
    if context.copy_bytes_per_second <= 0:
        return False
    copy_s = 2 * num_copy_blocks * context.bytes_per_block / context.copy_bytes_per_second
    return copy_s <= num_copy_tokens * context.seconds_per_token


class OffloadingConnector(KVConnectorBase):
    """Plans the tier's saves, loads and swaps (see the module docstring)."""

    def __init__(self, config: "KVTransferConfig", context: KVConnectorContext) -> None:
        if config.kv_offload_size is None:
            raise ValueError("kv_offload_size: the OffloadingConnector needs a tier size (GiB)")
        if context.kv_role != "kv_both":
            raise ValueError(f"kv_role: the OffloadingConnector saves and loads its own KV "
                             f"(kv_both), not {context.kv_role}")
        if config.kv_connector_extra_config:
            raise ValueError(f"kv_connector_extra_config: the OffloadingConnector takes no options "
                             f"(got {sorted(config.kv_connector_extra_config)[0]!r})")
        self.context = context
        self.block_size = context.block_size
        self.mode = context.preemption_mode
        self.tier = HostTier(tier_num_slots(config.kv_offload_size, context.bytes_per_block))
        self.kv: AnyKVCacheManager | None = None
        self.shares_prefixes = True  # set from the KV cache manager when bound
        # Per group, its window (None: full attention); one full group until bound.
        self.windows: tuple[int | None, ...] = (None,)
        self._null_block: Any = None  # the hybrid manager's stand-in behind a window
        self._requests: dict[str, Request] = {}  # admitted, not finished
        self._num_checked_blocks: dict[str, int] = {}  # req_id -> full blocks saved or found
        self._swapped: dict[str, SwappedKV] = {}
        self._matched: dict[str, tuple[int, GroupSlots]] = {}  # req_id -> (first position, slots)
        # Loads issued, not reported yet: req_id -> [(block id, slot)].
        self._loading: dict[str, list[tuple[int, int]]] = {}
        self._meta = OffloadingMetadata()
        self._pinned_this_step: list[int] = []
        self._stats = PrefixCacheStats()  # since the last make_prefix_cache_stats
        self.num_hit_tokens = 0  # tier hits since start (swaps back included)
        self.num_swapped_out = 0
        self.num_swapped_blocks = 0

    def bind_kv_cache_manager(self, kv_cache_manager: AnyKVCacheManager) -> None:
        self.kv = kv_cache_manager
        # With prefix caching off no request reuses another's KV: the tier then
        # only holds swapped requests' own KV (no write-through saves, no hits).
        self.shares_prefixes = kv_cache_manager.enable_caching
        self.windows = tuple(getattr(kv_cache_manager, "sliding_windows", (None,)))
        self._null_block = getattr(kv_cache_manager, "null_block", None)

    def _key(self, block_hash: Any, group: int) -> Any:
        """A slot's key: the block's hash, with its group beyond the first (the prefix cache's keys)."""
        return block_hash if group == 0 else (block_hash, group)

    def _first_read(self, group: int, num_tokens: int) -> int:
        """The first position group ``group`` reads once ``num_tokens`` are computed."""
        window = self.windows[group]
        return 0 if window is None else first_entry_in_window(num_tokens, window, self.block_size)

    def _load_limit(self, request: "Request") -> int:
        """Tokens a load may bring at most: one is always computed (its logits), and a
        parent computes the block before its fork point (so the load is never cut
        short after it ran: a window group holds only what the end of the load reads)."""
        limit = request.num_tokens - 1
        if request.fork_point is not None:
            limit = min(limit, request.fork_point - self.block_size)
        return limit

    # ---- tier hits and swaps coming back -------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens after the local hits that the tier holds (a swap, else full
        blocks by hash); loaded asynchronously."""
        first = num_computed_tokens // self.block_size
        swapped = self._swapped.get(request.request_id)
        if swapped is not None:
            return self._match_swapped(request, swapped, first)
        if not self.shares_prefixes or request.sampling_params.needs_every_prompt_position:
            return 0, False  # prefix caching off; or every prompt position is computed for its logprobs
        max_blocks = max(0, self._load_limit(request)) // self.block_size
        if max_blocks <= first:
            self._stats.record(request.num_tokens, 0, False)
            return 0, False
        hashes = self.kv.block_hashes_of(request, max_blocks)
        end = self._longest_tier_hit(hashes, first, max_blocks)
        num_hit_tokens = (end - first) * self.block_size
        self._stats.record(request.num_tokens, num_hit_tokens, False)
        self.num_hit_tokens += num_hit_tokens
        if end <= first:
            return 0, False
        lookup, key = self.tier.lookup, self._key
        slots = tuple(
            [lookup(key(hashes[i], g)) if i >= self._first_read(g, end * self.block_size) else None
             for i in range(first, end)]
            for g in range(len(self.windows)))
        self._matched[request.request_id] = (first, slots)
        return num_hit_tokens, True

    def _longest_tier_hit(self, hashes: list[Any], first: int, max_blocks: int) -> int:
        """The end of the longest run of positions from ``first`` the tier holds
        in every group: each full group every position, each window group the
        positions its window reads at the run's end (the local hits hold the rest)."""
        lookup, key = self.tier.lookup, self._key
        end = max_blocks
        for g, window in enumerate(self.windows):
            if window is None:
                i = first
                while i < end and lookup(key(hashes[i], g)) is not None:
                    i += 1
                end = i
        changed = True
        while changed and end > first:  # each window group may lower the end: until all agree
            changed = False
            for g, window in enumerate(self.windows):
                if window is not None:
                    n = self._longest_window_run(hashes, g, window, first, end)
                    if n < end:
                        end, changed = n, True
        return end

    def _longest_window_run(self, hashes: list[Any], group: int, window: int, first: int, end: int) -> int:
        """Largest L <= ``end`` such that the tier holds the positions from
        max(first, the window's first at L) to L in window group ``group``."""
        need = -(-(window - 1) // self.block_size)  # positions a window spans before its end
        if need == 0:
            return end
        lookup, key = self.tier.lookup, self._key
        run = 0
        for i in range(end - 1, first - 1, -1):
            if lookup(key(hashes[i], group)) is not None:
                run += 1
                if run >= need:
                    return i + need
            else:
                run = 0
        return first + run  # every position from ``first`` on is held

    def would_load_async(self, request: "Request", num_computed_tokens: int) -> bool:
        first = num_computed_tokens // self.block_size
        swapped = self._swapped.get(request.request_id)
        if swapped is not None:
            return min(swapped.num_tokens, self._load_limit(request)) > first * self.block_size
        if not self.shares_prefixes or request.sampling_params.needs_every_prompt_position:
            return False
        max_blocks = max(0, self._load_limit(request)) // self.block_size
        if first >= max_blocks:
            return False
        hashes = self.kv.block_hashes_of(request, max_blocks)
        return self._longest_tier_hit(hashes, first, max_blocks) > first

    def _match_swapped(self, request: "Request", swapped: SwappedKV, first: int) -> tuple[int, bool]:
        num_tokens = min(swapped.num_tokens, self._load_limit(request))
        num_external = num_tokens - first * self.block_size
        if num_external > 0 and not self._swap_covers(swapped, first, num_tokens):
            num_external = 0  # (a window entry the end reads was not swapped out: recomputed)
        self._stats.record(request.num_tokens, max(0, num_external), True)
        self.num_hit_tokens += max(0, num_external)
        if num_external <= 0:  # the local hits cover it: nothing to load
            self._release_swap(request.request_id)
            return 0, False
        last = -(-num_tokens // self.block_size)
        slots = tuple(
            [slot if i >= self._first_read(g, num_tokens) else None
             for i, slot in zip(range(first, last), group_slots[first:last])]
            for g, group_slots in enumerate(swapped.slots))
        self._matched[request.request_id] = (first, slots)
        return num_external, True

    def _swap_covers(self, swapped: SwappedKV, first: int, num_tokens: int) -> bool:
        """Whether the swapped slots hold every position from ``first`` that a load
        of ``num_tokens`` tokens must bring, in every group."""
        last = -(-num_tokens // self.block_size)
        return all(group_slots[i] is not None
                   for g, group_slots in enumerate(swapped.slots)
                   for i in range(max(first, self._first_read(g, num_tokens)), last))

    def update_state_after_alloc(
        self, request: "Request", blocks: "Blocks", num_external_tokens: int
    ) -> None:
        """Plan the loads of the matched slots into the blocks just allocated."""
        req_id = request.request_id
        self._requests[req_id] = request
        matched = self._matched.pop(req_id, None)
        if not num_external_tokens or matched is None:
            return
        first, slots = matched
        orders, loading = [], []
        tier = self.tier
        for group_blocks, group_slots in zip(as_groups(blocks), slots):
            for block, slot in zip(group_blocks[first:first + len(group_slots)], group_slots):
                if slot is None:
                    continue  # behind the window at the load's end: never read
                tier.pin(slot)
                tier.touch(slot)
                self._pinned_this_step.append(slot)
                orders.append((block.block_id, slot, tier.slot_tag[slot]))
                loading.append((block.block_id, slot))
        self._meta.loads[req_id] = orders
        self._loading[req_id] = loading
        self._release_swap(req_id)  # its slots stay pinned until the orders are issued

    # ---- swap out --------------------------------------------------------

    def request_preempted(self, request: "Request") -> bool:
        """Swap the victim's KV out when the mode or the cost model says so
        and the tier has room; False: it is recomputed."""
        if not self._may_swap(request):
            return False
        num_tokens = request.num_computed_tokens
        num_blocks = -(-num_tokens // self.block_size)
        groups = as_groups(self.kv.req_to_blocks[request.request_id])
        hashes = self.kv.block_hashes_of(request, num_tokens // self.block_size)
        null = self._null_block
        # Per group and position: the block (None behind a window), and the slot already holding it.
        present = [[b if b is not null else None for b in blocks[:num_blocks]] for blocks in groups]
        held = [[self._tier_slot_of(hashes, g, i, num_tokens) if block is not None else None
                 for i, block in enumerate(blocks)] for g, blocks in enumerate(present)]
        copies = [sum(1 for block, slot in zip(blocks, slots) if block is not None and slot is None)
                  for blocks, slots in zip(present, held)]
        num_copies = sum(copies)
        # Recomputing costs every layer of the positions some group would copy.
        if self.mode == "auto" and not swap_is_cheaper(
                max(copies) * self.block_size, num_copies, self.context):
            return False
        slots = self._swap_slots(present, held, hashes, num_tokens)
        if slots is None:
            return False  # the tier is full of pinned slots
        self._swapped[request.request_id] = SwappedKV(num_tokens, slots)
        self.num_swapped_out += 1
        self.num_swapped_blocks += num_copies
        return True

    def _may_swap(self, request: "Request") -> bool:
        if self.mode == "recompute" or request.num_computed_tokens <= 0:
            return False
        # Recomputed: prompt logprobs (emitted as computed), multimodal inputs,
        # drafts in flight (their KV may be rejected).
        return (not request.sampling_params.needs_every_prompt_position and not request.mm_positions
                and request.num_output_placeholders <= 1)

    def _tier_slot_of(self, hashes: list[Any], group: int, index: int, num_tokens: int) -> int | None:
        """The slot already holding position ``index`` of ``group`` (full blocks only)."""
        if (index + 1) * self.block_size > num_tokens:
            return None
        return self.tier.lookup(self._key(hashes[index], group))

    def _swap_slots(
        self, present: list[list[Any]], held: list[list[int | None]], hashes: list[Any], num_tokens: int
    ) -> GroupSlots | None:
        """Pin the slots holding the victim's blocks, copying those not held
        yet; None (nothing changed) when the tier runs out of slots."""
        tier = self.tier
        already = [slot for slots in held for slot in slots if slot is not None]
        # Pin the held slots first: allocating a slot for one block must not
        # evict the slot that holds another block of the same victim.
        for slot in already:
            tier.pin(slot)
        # Then every slot to copy into, before any write: a write makes a
        # slot findable by its hash, so a copy must never be planned unless
        # all of them are (an order never issued would leave the slot unwritten).
        fresh: dict[tuple[int, int], int] = {}  # (group, position) -> a newly allocated slot
        for g, (blocks, slots) in enumerate(zip(present, held)):
            for i, (block, slot) in enumerate(zip(blocks, slots)):
                if block is None or slot is not None:
                    continue
                slot = tier.allocate()
                if slot is None:
                    for taken in [*fresh.values(), *already]:
                        tier.unpin(taken)
                    return None
                fresh[g, i] = slot
        for (g, i), slot in fresh.items():
            full = (i + 1) * self.block_size <= num_tokens
            tag = tier.write(slot, self._key(hashes[i], g) if full else None)
            self._meta.swap_outs.append((present[g][i].block_id, slot, tag))
        return tuple([fresh.get((g, i), slot) for i, slot in enumerate(slots)]
                     for g, slots in enumerate(held))

    def _release_swap(self, req_id: str) -> None:
        swapped = self._swapped.pop(req_id, None)
        if swapped is not None:
            self._pinned_this_step.extend(swapped.pinned())  # unpinned once the orders are issued

    # ---- the step's orders -------------------------------------------------

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> OffloadingMetadata:
        """This step's orders: swap-outs and loads planned while scheduling,
        then saves of the blocks the step fills."""
        self._plan_saves(scheduler_output.num_scheduled_tokens)
        meta, self._meta = self._meta, OffloadingMetadata()
        # The orders are issued: later steps' orders execute after them.
        for slot in self._pinned_this_step:
            self.tier.unpin(slot)
        self._pinned_this_step = []
        self._matched.clear()
        return meta

    def _plan_saves(self, num_scheduled_tokens: dict[str, int]) -> None:
        if not self.shares_prefixes:
            return  # saves only ever serve prefix hits
        checked = self._num_checked_blocks
        for req_id, num_new in num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None:
                continue  # a forked child running on its parent's blocks
            # Blocks full of known tokens once this step ran (not drafts, not placeholders).
            num_full = min(request.num_tokens, request.num_computed_tokens + num_new) // self.block_size
            first = checked.get(req_id, 0)
            if num_full <= first:
                continue
            hashes = self.kv.block_hashes_of(request, num_full)
            checked[req_id] = self._save_blocks(
                as_groups(self.kv.req_to_blocks[req_id]), hashes, first, num_full)

    def _save_blocks(self, groups: tuple[list[Any], ...], hashes: list[Any], first: int, num_full: int) -> int:
        """Plan saves of positions ``first`` to ``num_full`` in every group (a
        window group's null entries aside); the end of what was saved or found."""
        tier, saves, null, key = self.tier, self._meta.saves, self._null_block, self._key
        for i in range(first, num_full):
            for g, blocks in enumerate(groups):
                block = blocks[i]
                if block is null:
                    continue
                slot = tier.lookup(key(hashes[i], g))
                if slot is not None:
                    tier.touch(slot)
                    continue
                slot = tier.allocate()
                if slot is None:
                    return i  # the tier is full of pinned slots: the rest is checked again later
                saves.append((block.block_id, slot, tier.write(slot, key(hashes[i], g))))
                self._pinned_this_step.append(slot)
        return num_full

    # ---- results and endings -------------------------------------------

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        """Loads that ended are forgotten; slots whose load failed are dropped
        from the tier, so the request recomputes and nobody loads them again."""
        invalid = connector_output.invalid_block_ids or ()
        for req_id in connector_output.finished_recving or ():
            for block_id, slot in self._loading.pop(req_id, ()):
                if block_id in invalid:
                    self.tier.invalidate(slot)

    def request_finished(self, request: "Request", block_ids: Any) -> tuple[bool, dict | None]:
        req_id = request.request_id
        self._requests.pop(req_id, None)
        self._num_checked_blocks.pop(req_id, None)
        self._matched.pop(req_id, None)
        self._loading.pop(req_id, None)
        swapped = self._swapped.pop(req_id, None)
        if swapped is not None:
            for slot in swapped.pinned():
                self.tier.unpin(slot)
        return False, None

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        stats, self._stats = self._stats, PrefixCacheStats()
        return stats
