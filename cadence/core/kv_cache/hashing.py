"""Chained block hashes for prefix caching.

The hash of block i covers its tokens *and* the hash of block i-1, so two
blocks with equal tokens after different prefixes never match:

    hash(b0) = H(ROOT,     tokens[0:16],  extra)
    hash(b1) = H(hash(b0), tokens[16:32], extra)

Only full blocks are hashed. ``extra`` carries what else changes the KV of
those tokens (the LoRA adapter, multimodal item hashes).
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any, Callable, Iterable

ROOT_HASH = 0x5CA1AB1E

BlockHashFn = Callable[[Any, tuple, Any], Any]


def builtin_block_hash(parent: Any, token_ids: tuple, extra: Any) -> int:
    """Python's tuple hash: fast, stable only within one process."""
    return hash((parent, token_ids, extra))


def sha256_block_hash(parent: Any, token_ids: tuple, extra: Any) -> bytes:
    """SHA-256 of the pickled triple: stable across processes and machines."""
    return hashlib.sha256(pickle.dumps((parent, token_ids, extra), protocol=5)).digest()


BLOCK_HASH_FNS: dict[str, BlockHashFn] = {
    "builtin": builtin_block_hash,
    "sha256": sha256_block_hash,
}


def extend_block_hashes(
    block_hashes: list[Any],
    token_ids: list[int],
    num_full_blocks: int,
    block_size: int,
    hash_fn: BlockHashFn,
    extra: Any = None,
) -> None:
    """Append hashes to ``block_hashes`` until it covers ``num_full_blocks``
    blocks (full ones: ``token_ids`` holds at least that many)."""
    first = len(block_hashes)
    block_token_tuples: Iterable[tuple[int, ...]]
    if num_full_blocks - first > 1:
        # A prompt's blocks: zip over block_size references to one iterator
        # yields one tuple per block, without a slice per block.
        tokens = iter(token_ids[first * block_size:num_full_blocks * block_size])
        block_token_tuples = zip(*[tokens] * block_size)
    elif num_full_blocks == first + 1:  # a decode filled one block
        block_token_tuples = (tuple(token_ids[first * block_size:num_full_blocks * block_size]),)
    else:
        return
    parent = block_hashes[-1] if block_hashes else ROOT_HASH
    if hash_fn is builtin_block_hash:  # inlined: a call per block costs as much as the hash
        for block_token_ids in block_token_tuples:
            parent = hash((parent, block_token_ids, extra))
            block_hashes.append(parent)
    else:
        for block_token_ids in block_token_tuples:
            parent = hash_fn(parent, block_token_ids, extra)
            block_hashes.append(parent)
