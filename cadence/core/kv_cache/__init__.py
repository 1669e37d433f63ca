"""Paged KV-cache bookkeeping: the block pool, prefix cache and per-request blocks."""

from cadence.core.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from cadence.core.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from cadence.core.kv_cache.manager import KVCacheManager

__all__ = [
    "AllBlocksCleared", "BlockPool", "BlockRemoved", "BlockStored", "FreeBlockQueue",
    "KVCacheBlock", "KVCacheManager",
]
