"""The paged KV cache: per-layer key and value tensors cut into fixed-size blocks.

The scheduler's KV cache manager hands out block ids; this module owns the
memory those ids name. A token's *slot* is where its key and value live:

    slot = block_id * block_size + offset_in_block

so one layer's cache, viewed flat as ``[num_blocks * block_size, Hkv, D]``,
is indexed by slot directly. Writing a step's new keys and values is a single
scatter per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cadence.runner import kv_quant
from cadence.runner.cpu_paths import DTYPES
from cadence.runner.host_memory import untouched_zeros

if TYPE_CHECKING:
    from cadence.core.kv_cache.groups import KVCacheLayout
    from cadence.models.config import ModelConfig


# The cache dtypes an option names: the float types, and q8_0 blocks (see kv_quant).
CACHE_DTYPES = DTYPES | {"q8_0": kv_quant.Q8_0}


def cache_dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``float16``, the q8_0 cache's storage -> ``q8_0``, as options spell them."""
    return next(name for name, value in CACHE_DTYPES.items() if value == dtype)


def auto_kv_cache_dtype(model_dtype: torch.dtype, device: torch.device) -> tuple[torch.dtype, str]:
    """What ``kv_cache_dtype="auto"`` resolves to, and why (for the start-up log).

    On the CPU a float32 model keeps its cache in float16, as llama.cpp does:
    half the bytes per token at the same speed (BENCHMARKS.md, defaults-v1:
    single stream, batch 64 and prefill within 2% of a float32 cache on the
    default model, the C attention kernel widening float16 as it reads);
    every other case keeps the model's dtype.
    """
    if device.type == "cpu" and model_dtype == torch.float32:
        return torch.float16, "auto: a float32 model's cache in float16 on the CPU, half the bytes at the same speed"
    return model_dtype, "auto: the model's dtype"


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The cache's element type for option ``name`` (``auto``: ``auto_kv_cache_dtype``).

    Keys and values are rounded to it as they are written and widened back to
    the model's dtype as attention reads them. Only the CPU path reads a cache
    of another dtype than the model's; a GPU cache stays in the model's.
    """
    if name == "auto":
        return auto_kv_cache_dtype(model_dtype, device)[0]
    if name not in CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: must be auto or one of {tuple(CACHE_DTYPES)}, got {name!r}")
    dtype = CACHE_DTYPES[name]
    if device.type != "cpu" and dtype != model_dtype:
        raise ValueError(f"kv_cache_dtype: {name} differs from the model's "
                         f"{str(model_dtype).removeprefix('torch.')}; on {device.type} the cache "
                         f"takes the model's dtype (use auto); other cache dtypes run on the CPU")
    return dtype


def bytes_per_block(
    model_config: "ModelConfig", block_size: int, dtype: torch.dtype, layout: "KVCacheLayout | None" = None
) -> int:
    """Memory one block takes across all layers (with KV cache groups, one
    group's layers: ``layout.layers_per_group``), keys and values together."""
    per_token = model_config.num_key_value_heads * kv_quant.row_elements(model_config.head_dim, dtype) * dtype.itemsize
    num_layers = model_config.num_hidden_layers if layout is None else layout.layers_per_group
    return 2 * num_layers * block_size * per_token


def num_blocks_for_budget(
    budget_bytes: int, model_config: "ModelConfig", block_size: int, dtype: torch.dtype,
    layout: "KVCacheLayout | None" = None,
) -> int:
    """How many whole blocks fit in ``budget_bytes`` (0 when not even one does)."""
    return max(0, int(budget_bytes) // bytes_per_block(model_config, block_size, dtype, layout))


@dataclass
class PagedKVCache:
    """Key and value caches of every layer, each ``[num_blocks, block_size, Hkv, D]``.

    Both live in one tensor ``[L, 2, num_blocks, block_size, Hkv, D]`` so the
    whole cache is one allocation; ``keys(layer)`` and ``values(layer)`` are
    views of one layer's blocks. Token-major blocks (``[block_size, Hkv, D]``)
    make a block one contiguous chunk, so attention gathers whole blocks with
    a single ``index_select`` instead of token by token.
    """

    data: torch.Tensor  # [L, 2, num_blocks, block_size, Hkv, D]
    # With KV cache groups (``cadence.core.kv_cache.groups``) the first axis is a
    # group's layer slots, and block b of slot s holds whichever layer of block
    # b's group sits in slot s: layer -> slot here. None: layer l is slot l.
    layer_slots: tuple[int, ...] | None = None

    @classmethod
    def allocate(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        layer_slots: tuple[int, ...] | None = None,
    ) -> "PagedKVCache":
        """``layer_slots``: layer -> slot, with ``num_layers`` slots (KV cache groups)."""
        kv_quant.check_head_dim(head_dim, dtype)
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, kv_quant.row_elements(head_dim, dtype))
        # Zeros, not empty: padded reads of unused slots must never see NaN/inf
        # (they are masked out, but 0 * NaN would still poison a softmax).
        if torch.device(device).type == "cpu":
            # Committed as blocks are first written: the block pool hands out
            # low ids first and reuses a freed block that holds no cached
            # prefix before any other, so a light load touches the cache's
            # first pages only (issue 31: memory follows the work).
            return cls(untouched_zeros(shape, dtype), layer_slots)
        return cls(torch.zeros(shape, dtype=dtype, device=device), layer_slots)

    @classmethod
    def for_model(
        cls,
        model_config: "ModelConfig",
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        layout: "KVCacheLayout | None" = None,
    ) -> "PagedKVCache":
        """``layout``: KV cache groups (None or one full group: a slot per layer)."""
        layer_slots, num_layers = None, model_config.num_hidden_layers
        if layout is not None and layout.num_groups > 1:
            slot_of = layout.layer_slot()
            layer_slots = tuple(slot_of[layer] for layer in range(num_layers))
            num_layers = layout.layers_per_group
        return cls.allocate(
            num_layers=num_layers,
            layer_slots=layer_slots,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=model_config.num_key_value_heads,
            head_dim=model_config.head_dim,
            dtype=dtype,
            device=device,
        )

    @property
    def num_layers(self) -> int:
        return self.data.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.data.shape[2]

    @property
    def block_size(self) -> int:
        return self.data.shape[3]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def quantized(self) -> bool:
        """Whether the cache holds q8_0 blocks (``kv_quant``), not float values."""
        return self.data.dtype == kv_quant.Q8_0

    def keys(self, layer_idx: int) -> torch.Tensor:
        """Key blocks of one layer, ``[num_blocks, block_size, Hkv, D]`` (a view; for
        q8_0, D / 32 * 34 bytes per head)."""
        slot = layer_idx if self.layer_slots is None else self.layer_slots[layer_idx]
        return self.data[slot, 0]

    def values(self, layer_idx: int) -> torch.Tensor:
        """Value blocks of one layer, ``[num_blocks, block_size, Hkv, D]`` (a view)."""
        slot = layer_idx if self.layer_slots is None else self.layer_slots[layer_idx]
        return self.data[slot, 1]

    def write(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store new keys/values ``[T, Hkv, D]`` at ``slot_mapping`` ``[T]`` (int64)."""
        # 2-D views [num_slots, Hkv*D]: one row copy per token (fast on CPU).
        num_slots, row = self.num_slots, k.shape[1] * k.shape[2]
        stored = kv_quant.row_elements(row, self.data.dtype)
        keys = self.keys(layer_idx).view(num_slots, stored)
        values = self.values(layer_idx).view(num_slots, stored)
        keys.index_copy_(0, slot_mapping, self._stored(k.reshape(-1, row)))
        values.index_copy_(0, slot_mapping, self._stored(v.reshape(-1, row)))

    def _stored(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows of values as the cache holds them."""
        return kv_quant.encode(rows) if self.quantized else rows.to(self.data.dtype)
