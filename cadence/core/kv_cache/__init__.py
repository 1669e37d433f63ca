"""Paged KV-cache bookkeeping: the block pool, prefix cache and per-request blocks."""

from typing import Any

from cadence.core.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from cadence.core.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from cadence.core.kv_cache.groups import KVCacheGroup, KVCacheLayout, plan_kv_cache_layout, single_group
from cadence.core.kv_cache.hybrid import HybridKVCacheManager
from cadence.core.kv_cache.interface import KVCacheManagerBase
from cadence.core.kv_cache.manager import KVCacheManager

# Either manager, where a module needs no more than the methods' names (policies,
# connectors): any object. The scheduler holds its own as KVCacheManagerBase.
AnyKVCacheManager = Any
# A request's block ids as the runner gets them: one list, or one list per group.
BlockIds = list[int] | tuple[list[int], ...]
# A request's blocks: one list, or one per KV cache group.
Blocks = list[KVCacheBlock] | tuple[list[KVCacheBlock], ...]

__all__ = [
    "AllBlocksCleared", "BlockPool", "BlockRemoved", "BlockStored", "FreeBlockQueue",
    "AnyKVCacheManager", "BlockIds", "Blocks", "HybridKVCacheManager", "KVCacheBlock", "KVCacheGroup", "KVCacheLayout", "KVCacheManager",
    "KVCacheManagerBase",
    "make_kv_cache_manager", "plan_kv_cache_layout", "single_group",
]


def make_kv_cache_manager(num_blocks: int, block_size: int, max_model_len: int | None, *,
                          layout: KVCacheLayout | None = None, **options) -> KVCacheManagerBase:
    """The plain manager for one full-attention group (``layout`` None), else the hybrid one."""
    if layout is None or not layout.is_hybrid:
        return KVCacheManager(num_blocks, block_size, max_model_len, **options)
    return HybridKVCacheManager(num_blocks, block_size, max_model_len,
                                sliding_windows=layout.sliding_windows, **options)
