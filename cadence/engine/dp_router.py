"""Which data-parallel replica serves a request: round robin, least loaded, or cache aware.

The front end (``cadence.engine.dp_client``) and the simulator (``cadence.sim.dp``)
route through this one module; it is pure Python (no sockets, no torch) and
learns everything from three calls:

    route(req_id, prompt_token_ids, num_output_tokens)   -> rank (or None: no replica alive)
    release(req_id)                                      the request finished, failed or was aborted
    absorb_kv_events(rank, events)                       the replica's KV-cache events of one step

Load. A replica's load is the tokens its requests still hold to process, as
the front end can know them without asking: each routed request adds its
prompt tokens the replica does not hold cached plus its output tokens (the
limit, ``max_tokens`` times ``n``), and gives them back when it ends.

Prefix affinity. Every replica publishes the blocks that enter and leave its
prefix cache (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``). A
replica's own block hashes may be per process (the builtin hash), so the
router rehashes each stored block's tokens with its own chained hash and
keeps, per replica, the replica's hash -> the router's:

    router hash of block i = H(router hash of block i-1, tokens of block i, extra key)
    holders[router hash]   = the ranks whose cache holds that block

Events come after the fact (a replica stores a prompt's blocks when its
prefill is done), so the router also counts the prompts of the requests in
flight on each replica as held there: a burst of requests sharing a prefix
follows the first one. A prompt's match on a replica is the number of its
leading full blocks that the replica holds or will hold, all of them in a row.

The imbalance bound (cache aware). The replica with the longest match serves
(the least loaded among equals) unless its load passes the least loaded
replica's by more than the prompt tokens its cache saves over the least
loaded one's, or by more than ``load_margin_tokens``; then the least loaded
serves. So affinity never queues more work than it saves, and a chosen
replica's load never exceeds the least loaded one's by more than the margin,
whatever the prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from cadence.config import DP_ROUTING_POLICIES
from cadence.core.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from cadence.core.kv_cache.hashing import ROOT_HASH, builtin_block_hash, extend_block_hashes


@dataclass(frozen=True)
class Routed:
    """What ``route`` decided for one request, kept until ``release``."""

    rank: int
    num_tokens: int  # the load it added to its replica
    num_cached_tokens: int  # prompt tokens the replica held cached when it was routed
    block_hashes: tuple[int, ...] = ()  # the prompt's, counted in flight (cache aware only)


class PrefixIndex:
    """Which replica holds which prompt blocks, learned from their cache events."""

    def __init__(self, num_replicas: int, block_size: int) -> None:
        self.block_size = block_size
        self.holders: dict[int, set[int]] = {}  # router hash -> ranks
        # router hash -> rank -> requests in flight there whose prompt has that block
        self.in_flight: dict[int, dict[int, int]] = {}
        # Per replica: its block hash -> the router's hash of that block.
        self._own_hashes: list[dict[Any, int]] = [{} for _ in range(num_replicas)]

    def absorb(self, rank: int, events: Iterable[KVCacheEvent]) -> None:
        for event in events:
            # Group 0 only (with KV cache groups: the full-attention layers, which a hit needs whole).
            if isinstance(event, BlockStored):
                if not event.group:
                    self._store(rank, event)
            elif isinstance(event, BlockRemoved):
                if not event.group:
                    self._remove(rank, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.forget(rank)

    def forget(self, rank: int) -> None:
        """The replica holds nothing (cleared its cache, or died)."""
        own = self._own_hashes[rank]
        self._remove(rank, list(own))

    def num_held_blocks(self, rank: int) -> int:
        """Blocks ``rank``'s cache holds, as its events told."""
        return len(self._own_hashes[rank])

    def num_matched_blocks(self, block_hashes: Sequence[int], rank: int) -> int:
        """Leading blocks ``rank`` holds (or a request in flight there will hold)."""
        num = 0
        for block_hash in block_hashes:
            if rank not in self.holders.get(block_hash, ()) \
                    and rank not in self.in_flight.get(block_hash, ()):
                break
            num += 1
        return num

    def add_in_flight(self, rank: int, block_hashes: Iterable[int]) -> None:
        for block_hash in block_hashes:
            counts = self.in_flight.setdefault(block_hash, {})
            counts[rank] = counts.get(rank, 0) + 1

    def remove_in_flight(self, rank: int, block_hashes: Iterable[int]) -> None:
        for block_hash in block_hashes:
            counts = self.in_flight[block_hash]
            counts[rank] -= 1
            if not counts[rank]:
                del counts[rank]
                if not counts:
                    del self.in_flight[block_hash]

    def prompt_hashes(self, prompt_token_ids: Sequence[int], extra_key: Any = None) -> list[int]:
        """The router's chained hashes of the prompt's full blocks."""
        hashes: list[int] = []
        num_full = len(prompt_token_ids) // self.block_size
        extend_block_hashes(hashes, list(prompt_token_ids), num_full, self.block_size,
                            builtin_block_hash, extra_key)
        return hashes

    def _store(self, rank: int, event: BlockStored) -> None:
        own = self._own_hashes[rank]
        parent = own.get(event.parent_block_hash)
        if parent is None:
            if event.parent_block_hash != ROOT_HASH:
                return  # its parent left the cache (or an event was missed): unreachable
            parent = ROOT_HASH
        size = event.block_size
        for i, own_hash in enumerate(event.block_hashes):
            tokens = tuple(event.token_ids[i * size:(i + 1) * size])
            if len(tokens) < size:
                return
            parent = builtin_block_hash(parent, tokens, event.extra_key)
            own[own_hash] = parent
            self.holders.setdefault(parent, set()).add(rank)

    def _remove(self, rank: int, own_hashes: Iterable[Any]) -> None:
        own = self._own_hashes[rank]
        for own_hash in own_hashes:
            router_hash = own.pop(own_hash, None)
            if router_hash is None:
                continue
            ranks = self.holders.get(router_hash)
            if ranks is not None:
                ranks.discard(rank)
                if not ranks:
                    del self.holders[router_hash]


class DPRouter:
    """Routes requests over ``num_replicas`` replicas (see the module docstring)."""

    def __init__(self, num_replicas: int, policy: str = "cache_aware", *, block_size: int = 16,
                 load_margin_tokens: int = 8192) -> None:
        if policy not in DP_ROUTING_POLICIES:
            raise ValueError(f"dp_routing: must be one of {', '.join(DP_ROUTING_POLICIES)}, "
                             f"got {policy!r}")
        if num_replicas < 1:
            raise ValueError("data_parallel_size: must be >= 1")
        self.policy = policy
        self.load_margin_tokens = load_margin_tokens
        self.loads = [0] * num_replicas  # queued and running tokens per replica
        self.num_requests = [0] * num_replicas  # requests in flight per replica
        self.num_routed_total = [0] * num_replicas  # requests ever routed per replica
        self.alive = [True] * num_replicas
        self.index = PrefixIndex(num_replicas, block_size)
        self.routed: dict[str, Routed] = {}
        self._next_rank = 0  # whose turn it is (round robin; idle replicas under the others)

    @property
    def num_replicas(self) -> int:
        return len(self.loads)

    def route(self, req_id: str, prompt_token_ids: Sequence[int], num_output_tokens: int,
              extra_key: Any = None) -> int | None:
        """Choose the replica of a new request and count its load there; None when
        no replica is alive. ``req_id`` must not be in flight already."""
        alive = [rank for rank, up in enumerate(self.alive) if up]
        if not alive:
            return None
        matched, hashes = [0] * self.num_replicas, ()
        if self.policy == "cache_aware":
            hashes = tuple(self.index.prompt_hashes(prompt_token_ids, extra_key))
            matched = [self.index.num_matched_blocks(hashes, rank) for rank in range(self.num_replicas)]
        rank = self._choose(alive, matched)
        num_cached = matched[rank] * self.index.block_size
        num_tokens = len(prompt_token_ids) - num_cached + num_output_tokens
        self.routed[req_id] = Routed(rank, num_tokens, num_cached, hashes)
        self.index.add_in_flight(rank, hashes)
        self.loads[rank] += num_tokens
        self.num_requests[rank] += 1
        self.num_routed_total[rank] += 1
        return rank

    def release(self, req_id: str) -> Routed | None:
        """The request ended (finished, failed, aborted): its load leaves its replica."""
        routed = self.routed.pop(req_id, None)
        if routed is not None:
            self.loads[routed.rank] -= routed.num_tokens
            self.num_requests[routed.rank] -= 1
            self.index.remove_in_flight(routed.rank, routed.block_hashes)
        return routed

    def rank_of(self, req_id: str) -> int | None:
        routed = self.routed.get(req_id)
        return None if routed is None else routed.rank

    def absorb_kv_events(self, rank: int, events: Iterable[KVCacheEvent]) -> None:
        if self.alive[rank]:
            self.index.absorb(rank, events)

    def mark_dead(self, rank: int) -> list[str]:
        """Route nothing more to ``rank``; returns its requests in flight (released)."""
        self.alive[rank] = False
        self.index.forget(rank)
        lost = [req_id for req_id, routed in self.routed.items() if routed.rank == rank]
        for req_id in lost:
            self.release(req_id)
        return lost

    def _choose(self, alive: list[int], matched: list[int]) -> int:
        if self.policy == "round_robin":
            return self._take_turn(alive)
        least_loaded = self._least_loaded(alive)
        if self.policy == "least_loaded":
            return least_loaded
        best = max(alive, key=lambda rank: (matched[rank], -self.loads[rank], -rank))
        if matched[best] == 0:
            return least_loaded
        # Affinity may cost extra queued work up to the prefill it saves, and never
        # more than the margin (the bound): a shared system prompt of a few blocks
        # does not pull a burst onto one replica; a long shared prefix does.
        extra_load = self.loads[best] - self.loads[least_loaded]
        saved = (matched[best] - matched[least_loaded]) * self.index.block_size
        if extra_load > min(self.load_margin_tokens, saved):
            return least_loaded
        return best

    def _least_loaded(self, alive: list[int]) -> int:
        """Fewest tokens, then fewest requests; equals take turns (idle replicas share)."""
        loads, num_requests, n = self.loads, self.num_requests, self.num_replicas
        rank = min(alive, key=lambda r: (loads[r], num_requests[r], (r - self._next_rank) % n))
        if loads[rank] == 0 and num_requests[rank] == 0:
            self._next_rank = rank + 1
        return rank

    def _take_turn(self, alive: list[int]) -> int:
        rank = next((rank for rank in alive if rank >= self._next_rank), alive[0])
        self._next_rank = rank + 1
        return rank
