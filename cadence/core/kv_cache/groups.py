"""KV cache groups: layers that share an attention type share a block table.

A model whose layers all attend over the whole context has one group (and
the plain ``KVCacheManager``). Gemma 2/3 and Mistral-style models attend
over a window in some or all layers; a window layer never reads a key
older than its window, so its blocks behind the window can be freed.

Layers are split by attention type (full, or a window of W tokens) into
groups of *equal* size, as vLLM's hybrid allocator does: a page of the one
shared block pool then holds ``block_size`` tokens of keys and values for
one group's layers, whatever the group, and admission and preemption count
pages of a single pool. Gemma 3 270M (18 layers, every 6th global):

    full   layers 5 11 17          -> group 0
    window layers 0 1 2            -> group 1
           layers 3 4 6            -> group 2     (5 window groups of 3)
           ...

The runner's cache tensor is ``[layers_per_group, 2, num_blocks, ...]``:
layer ``l`` is slot ``layer_slot[l]`` of its group's pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that read one block table: all full attention, or all one window."""

    layer_ids: tuple[int, ...]
    sliding_window: int | None  # None: the whole context


@dataclass(frozen=True)
class KVCacheLayout:
    """The groups of a model's layers and where each layer's keys and values live."""

    groups: tuple[KVCacheGroup, ...]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def layers_per_group(self) -> int:
        """Layer slots in one page (the largest group; a smaller one leaves slots unused)."""
        return max(len(g.layer_ids) for g in self.groups)

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        return tuple(g.sliding_window for g in self.groups)

    @property
    def is_hybrid(self) -> bool:
        """Whether the plain one-table manager does not describe it (several groups or a window)."""
        return self.num_groups > 1 or self.groups[0].sliding_window is not None

    def group_of_layer(self) -> dict[int, int]:
        return {layer: g for g, group in enumerate(self.groups) for layer in group.layer_ids}

    def layer_slot(self) -> dict[int, int]:
        """Layer -> its slot within its group's pages."""
        return {layer: s for group in self.groups for s, layer in enumerate(group.layer_ids)}

    def num_blocks_per_request(self, num_tokens: int, block_size: int, max_num_batched_tokens: int) -> int:
        return blocks_per_request(self.sliding_windows, num_tokens, block_size, max_num_batched_tokens)

    def max_request_tokens(self, num_blocks: int, block_size: int, max_num_batched_tokens: int) -> int:
        """The longest request ``num_blocks`` blocks (the null block among them) hold, in tokens."""
        usable = num_blocks - 1
        lo, hi = 0, usable * block_size
        while lo < hi:  # the largest n with num_blocks_per_request(n) <= usable
            mid = (lo + hi + 1) // 2
            if self.num_blocks_per_request(mid, block_size, max_num_batched_tokens) <= usable:
                lo = mid
            else:
                hi = mid - 1
        if lo == hi == usable * block_size and not any(w is None for w in self.sliding_windows):
            return 1 << 40  # window groups only: any length fits once one window does
        return lo

    def describe(self) -> str:
        parts = []
        for group in self.groups:
            kind = "full" if group.sliding_window is None else f"window {group.sliding_window}"
            parts.append(f"{kind} [{','.join(map(str, group.layer_ids))}]")
        return f"{self.num_groups} KV cache groups of {self.layers_per_group} layers: " + "; ".join(parts)


def blocks_per_request(
    sliding_windows: tuple[int | None, ...], num_tokens: int, block_size: int, max_num_batched_tokens: int
) -> int:
    """Blocks one request of ``num_tokens`` tokens holds at most, all groups together.

    A window group holds, after the step's allocation freed what is behind the
    window of its first query, the window and the step's chunk (vLLM's bound):
    ceil((W - 1 + chunk) / block_size) + 1 blocks, the +1 for a window that
    starts inside a block.
    """
    full = -(-num_tokens // block_size)
    window_cap = lambda w: -(-(w - 1 + max_num_batched_tokens) // block_size) + 1  # noqa: E731
    return sum(full if w is None else min(full, window_cap(w)) for w in sliding_windows)


def first_entry_in_window(num_tokens: int, window: int, block_size: int) -> int:
    """The first block position a query at position ``num_tokens`` reads in a
    group of window ``window``: every block wholly before its first visible key
    (``num_tokens - window + 1``) is behind the window."""
    first_key = num_tokens - window + 1
    return first_key // block_size if first_key > 0 else 0


def as_groups(blocks: Any) -> tuple[list[Any], ...]:
    """A request's blocks (or block ids) per group: the hybrid manager gives a
    tuple of lists, the plain one a list (one group)."""
    return blocks if isinstance(blocks, tuple) else (blocks,)


def single_group(num_layers: int) -> KVCacheLayout:
    """Every layer in one full-attention group (what a model without windows gets)."""
    return KVCacheLayout((KVCacheGroup(tuple(range(num_layers)), None),))


def plan_kv_cache_layout(
    num_layers: int, sliding_window: int | None, full_attention_layers: tuple[int, ...] = ()
) -> KVCacheLayout:
    """Group the layers by attention type, in groups of equal size.

    The group size is the smallest type's layer count (vLLM's rule), so the
    smallest type fills one group and the others split into several.
    """
    if not sliding_window:
        return single_group(num_layers)
    full = [layer for layer in range(num_layers) if layer in set(full_attention_layers)]
    window = [layer for layer in range(num_layers) if layer not in set(full_attention_layers)]
    kinds = [(layers, w) for layers, w in ((full, None), (window, sliding_window)) if layers]
    size = min(len(layers) for layers, _ in kinds)
    groups = [
        KVCacheGroup(tuple(layers[i:i + size]), w)
        for layers, w in kinds for i in range(0, len(layers), size)
    ]
    return KVCacheLayout(tuple(groups))
