"""The offloading connector, worker side: the host-memory tier's bytes and
the copies the scheduler side orders (``cadence.core.kv_transfer.offloading``).

The tier is one tensor shaped like the paged cache with ``num_slots`` blocks,
``[L, 2, num_slots, block_size, Hkv, D]``: RAM on the CPU, pinned host memory
beside a GPU. Copies run on the runner's thread in step order, so they never
race the forward: swap-outs and loads before it, saves after it.

Each slot remembers the tag of the write that filled it; a load whose tag
does not match (a copy that failed, or never happened) fails, and a copy that
raises fails: a failed load's blocks are reported invalid and recomputed.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from cadence.core.kv_transfer.offloading import CopyOrder, OffloadingMetadata, tier_num_slots
from cadence.runner.kv_transfer.base import KVConnectorWorker

if TYPE_CHECKING:
    from cadence.config import KVTransferConfig
    from cadence.core.sched.kv_connector import KVConnectorContext
    from cadence.runner.kv_cache import PagedKVCache

logger = logging.getLogger(__name__)
_NO_TAG = 0  # the tag of a slot never written, or whose write failed


def _check_host_memory(num_bytes: int) -> None:
    """Refuse a tier larger than this machine's memory (it would be killed filling it)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return  # unknown: let the allocation decide
    if num_bytes > total:
        raise ValueError(f"kv_offload_size: the tier needs {num_bytes / 2**30:.1f} GiB, more than "
                         f"this machine's {total / 2**30:.1f} GiB of memory")


class OffloadingWorker(KVConnectorWorker):
    """Executes the tier's copy orders around each forward."""

    def __init__(self, config: "KVTransferConfig", context: "KVConnectorContext") -> None:
        self.num_slots = tier_num_slots(config.kv_offload_size, context.bytes_per_block)
        self.kv_cache: PagedKVCache | None = None
        self.tier: torch.Tensor | None = None  # [L, 2, num_slots, block_size, Hkv, D]
        self.slot_tags: dict[int, int] = {}  # slot -> tag of the write it holds
        self._recving: set[str] = set()
        self._invalid: set[int] = set()
        self._saves: list[CopyOrder] = []
        self.num_blocks_loaded = 0
        self.num_blocks_saved = 0
        self.num_load_errors = 0  # blocks whose load failed

    def register_kv_caches(self, kv_caches: "PagedKVCache") -> None:
        data = kv_caches.data
        shape = (data.shape[0], data.shape[1], self.num_slots, *data.shape[3:])
        if self.tier is None or self.tier.shape != shape or self.tier.dtype != data.dtype:
            _check_host_memory(self.num_slots * data[:, :, :1].nbytes)
            # Empty: pages are committed as slots are written (the tags guard reads).
            self.tier = torch.empty(shape, dtype=data.dtype, device="cpu",
                                    pin_memory=data.device.type == "cuda")
            self.slot_tags = {}
        self.kv_cache = kv_caches

    def start_load_kv(self, metadata: OffloadingMetadata | None) -> None:
        if metadata is None:
            return
        if metadata.swap_outs:
            self._copy_out(metadata.swap_outs)
        for req_id, orders in metadata.loads.items():
            self._load(orders)
            self._recving.add(req_id)
        self._saves = metadata.saves

    def wait_for_save(self) -> None:
        saves, self._saves = self._saves, []
        if saves:
            self._copy_out(saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        recving, self._recving = self._recving, set()
        return None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def shutdown(self) -> None:
        self.tier = None

    # ---- copies ---------------------------------------------------------

    def _copy_out(self, orders: list[CopyOrder]) -> None:
        """KV-cache blocks -> tier slots; a failed copy leaves its slots untagged."""
        block_ids = [block_id for block_id, _, _ in orders]
        slots = [slot for _, slot, _ in orders]
        try:
            data = self.kv_cache.data
            picked = data.index_select(2, torch.tensor(block_ids, device=data.device))
            self.tier.index_copy_(2, torch.tensor(slots), picked.to("cpu"))
        except (RuntimeError, IndexError) as error:
            logger.warning("KV tier: a copy of %d blocks to host memory failed (%s)", len(orders), error)
            for slot in slots:
                self.slot_tags[slot] = _NO_TAG
            return
        for _, slot, tag in orders:
            self.slot_tags[slot] = tag
        self.num_blocks_saved += len(orders)

    def _load(self, orders: list[CopyOrder]) -> None:
        """Tier slots -> KV-cache blocks; blocks whose slot does not hold the
        expected write, or whose copy fails, become invalid."""
        tags = self.slot_tags
        good = [order for order in orders if tags.get(order[1], _NO_TAG) == order[2]]
        if len(good) < len(orders):
            bad = [block_id for block_id, slot, tag in orders if tags.get(slot, _NO_TAG) != tag]
            self._invalid.update(bad)
            self.num_load_errors += len(bad)
        if not good:
            return
        block_ids = [block_id for block_id, _, _ in good]
        try:
            data = self.kv_cache.data
            picked = self.tier.index_select(2, torch.tensor([slot for _, slot, _ in good]))
            data.index_copy_(2, torch.tensor(block_ids, device=data.device),
                             picked.to(data.device, non_blocking=True))
        except (RuntimeError, IndexError) as error:
            logger.warning("KV tier: a load of %d blocks failed (%s)", len(good), error)
            self._invalid.update(block_ids)
            self.num_load_errors += len(block_ids)
            return
        self.num_blocks_loaded += len(good)
