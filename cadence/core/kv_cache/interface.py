"""What the scheduler asks of a KV cache manager, as one base class.

Two managers implement it: ``KVCacheManager`` (one group of layers, a
request's blocks in one list) and ``HybridKVCacheManager`` (a list per
group). Blocks pass through the scheduler without being looked at, so their
types here are ``Any``: each manager says what its own are.

The scheduler holds its manager as this type, so that in the compiled build
(``cadence.compile``) its calls per request and step are direct calls with
native integers, not calls by name through Python objects.
"""

from __future__ import annotations

from typing import Any

from cadence.core.kv_cache.block_pool import BlockPool
from cadence.core.kv_cache.events import KVCacheEvent
from cadence.core.outputs import PrefixCacheStats
from cadence.core.request import Request


class KVCacheManagerBase:
    """The scheduler's questions to a KV cache manager (see ``manager`` for
    what each one means with one group, ``hybrid`` with several)."""

    block_pool: BlockPool
    enable_caching: bool
    # req_id -> how many of its leading blocks are registered in the prefix cache.
    num_cached_blocks: dict[str, int]

    # ---- queries -------------------------------------------------------

    @property
    def usage(self) -> float:
        raise NotImplementedError

    def group_usage(self) -> dict[str, float]:
        raise NotImplementedError

    def get_block_ids(self, request_id: str) -> Any:
        raise NotImplementedError

    def get_computed_blocks(self, request: Request) -> tuple[Any, int]:
        raise NotImplementedError

    def num_cached_prefix_tokens(self, request: Request) -> int:
        raise NotImplementedError

    def cut_hits(self, hits: Any, num_blocks: int) -> tuple[Any, int]:
        raise NotImplementedError

    def get_num_common_prefix_blocks(self, request: Request, num_running_requests: int) -> int:
        raise NotImplementedError

    # ---- allocation and release ----------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_external_computed_tokens: int = 0,
    ) -> Any:
        raise NotImplementedError

    def free_behind_window(self, request: Request, num_computed_tokens: int) -> None:
        raise NotImplementedError

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        raise NotImplementedError

    def free(self, request: Request) -> None:
        raise NotImplementedError

    def free_block_hashes(self, request: Request) -> None:
        raise NotImplementedError

    def forget_blocks(self, request: Request, first: int, end: int) -> None:
        raise NotImplementedError

    def reset_prefix_cache(self) -> bool:
        raise NotImplementedError

    # ---- stats and events ----------------------------------------------

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        raise NotImplementedError

    def take_events(self) -> list[KVCacheEvent]:
        raise NotImplementedError
