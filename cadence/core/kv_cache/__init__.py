"""Paged KV-cache bookkeeping: the block pool, prefix cache and per-request blocks."""

from cadence.core.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from cadence.core.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from cadence.core.kv_cache.groups import KVCacheGroup, KVCacheLayout, plan_kv_cache_layout, single_group
from cadence.core.kv_cache.hybrid import HybridKVCacheManager
from cadence.core.kv_cache.manager import KVCacheManager

__all__ = [
    "AllBlocksCleared", "BlockPool", "BlockRemoved", "BlockStored", "FreeBlockQueue",
    "HybridKVCacheManager", "KVCacheBlock", "KVCacheGroup", "KVCacheLayout", "KVCacheManager",
    "make_kv_cache_manager", "plan_kv_cache_layout", "single_group",
]


def make_kv_cache_manager(num_blocks: int, block_size: int, max_model_len: int | None, *,
                          layout: KVCacheLayout | None = None, **options):
    """The plain manager for one full-attention group (``layout`` None), else the hybrid one."""
    if layout is None or not layout.is_hybrid:
        return KVCacheManager(num_blocks, block_size, max_model_len, **options)
    return HybridKVCacheManager(num_blocks, block_size, max_model_len,
                                sliding_windows=layout.sliding_windows, **options)
