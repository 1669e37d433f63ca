"""KV-cache events: what entered and left the prefix cache.

A router in front of several engine replicas consumes them to learn which
replica holds which prefix. On the wire (msgpack) each event is an array
tagged with its class name, as vLLM encodes its events:
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
extra_key]``, ``["BlockRemoved", block_hashes]``, ``["AllBlocksCleared"]``.

With KV cache groups (``groups.py``) each group's blocks have their own
events, under the block's hash and with ``group`` appended (left out for
group 0, so a cache of one group sends exactly the fields above). A router
that indexes prefixes reads group 0: the full-attention layers, which a
prefix hit needs whole.
"""

from __future__ import annotations

from typing import Any

import msgspec


class BlockStored(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """Full blocks registered in the prefix cache."""

    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    extra_key: Any = None  # e.g. the LoRA adapter id the KV was computed under
    group: int = 0  # the KV cache group whose block it is


class BlockRemoved(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """Blocks evicted from the prefix cache."""

    block_hashes: list[Any]
    group: int = 0  # the KV cache group whose blocks they were


class AllBlocksCleared(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
