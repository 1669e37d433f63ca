"""The GPU's side of a step: its inputs staged in one copy, and paged attention in Triton.

    StepInputs (host, numpy/torch CPU)
      -> stage_step(): every index array packed into one pinned int64 buffer,
         copied to the GPU once, then viewed back as separate tensors
      -> DeviceStep: input ids, positions, logits rows and GpuAttentionMetadata
      -> TritonPagedAttention: per layer, write the new keys/values to the
         cache, then one kernel call over the whole mixed batch

The attention kernel (``cadence.kernels.triton_attention``) reads keys and
values in place through the block table: nothing is gathered. The same
write-then-read invariant as on the CPU holds (see ``cadence.runner.attention``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cadence.kernels.triton_attention import TileShape, paged_attention, tiles_of
from cadence.runner.input_batch import StepInputs
from cadence.runner.kv_cache import PagedKVCache


@dataclass
class GpuAttentionMetadata:
    """What the kernel needs about one step, on the device, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [S + 1] int64
    seq_lens: torch.Tensor  # [S] int64: context length after this step
    block_table: torch.Tensor  # [S, max_blocks] int64
    tile_seq: torch.Tensor  # [num_tiles] int64
    tile_q_start: torch.Tensor  # [num_tiles] int64
    shape: TileShape
    sliding_window: int | None


@dataclass
class DeviceStep:
    """One step's model inputs on the device."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [N] int64
    attention: GpuAttentionMetadata


class StepStager:
    """Packs a step's index arrays into one pinned buffer and copies it to ``device`` once."""

    def __init__(self, device: torch.device, group: int, num_kv_heads: int,
                 sliding_window: int | None, num_sms: int | None = None) -> None:
        """``num_sms``: multiprocessors to fill (decode steps with few sequences
        split their keys); default the GPU's count, 0 (no splits) on the CPU."""
        self.device = device
        self.group = group  # query heads per KV head
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.num_sms = num_sms_of(device) if num_sms is None else num_sms
        self._pinned = torch.empty(0, dtype=torch.int64)

    def stage(self, step: StepInputs) -> DeviceStep:
        query_lens = np.diff(step.query_start_loc)
        max_query_len = int(query_lens.max())
        shape = TileShape.choose(self.group, max_query_len)
        if max_query_len == 1:  # one tile per sequence
            shape = TileShape.choose(self.group, 1, num_tiles=len(query_lens),
                                     num_kv_heads=self.num_kv_heads, num_sms=self.num_sms)
        tile_seq, tile_q_start = tiles_of(torch.from_numpy(query_lens), shape.block_q)
        parts = [
            step.input_ids, step.positions, step.logits_indices, step.slot_mapping,
            torch.from_numpy(step.query_start_loc), torch.from_numpy(step.seq_lens),
            tile_seq, tile_q_start, step.block_table.flatten(),
        ]
        flat = self._pack(parts)
        ids, pos, logits_rows, slots, starts, lens, t_seq, t_start, table = flat.split(
            [p.numel() for p in parts])
        metadata = GpuAttentionMetadata(
            slot_mapping=slots, query_start_loc=starts, seq_lens=lens,
            block_table=table.view(step.block_table.shape), tile_seq=t_seq,
            tile_q_start=t_start, shape=shape, sliding_window=self.sliding_window,
        )
        return DeviceStep(ids, pos, logits_rows, metadata)

    def _pack(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The parts end to end, on the device, after a single host-to-device copy."""
        total = sum(p.numel() for p in parts)
        if self._pinned.numel() < total:
            pin = self.device.type == "cuda"
            self._pinned = torch.empty(max(total, 2 * self._pinned.numel()), dtype=torch.int64,
                                       pin_memory=pin)
        host = self._pinned[:total]
        torch.cat([p.to(torch.int64).flatten() for p in parts], out=host)
        # Non-blocking from pinned memory; the step's sampled tokens come back
        # through a synchronising copy, so the buffer is free again by the next step.
        return host.to(self.device, non_blocking=True)


def num_sms_of(device: torch.device) -> int:
    """The GPU's multiprocessor count (0 on the CPU)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


class TritonPagedAttention:
    """The model's attention callable for one step on the GPU: ``(layer, q, k, v) -> out``."""

    def __init__(self, kv_cache: PagedKVCache, metadata: GpuAttentionMetadata,
                 *, scale: float | None = None) -> None:
        self.kv_cache = kv_cache
        self.metadata = metadata
        self.scale = scale

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.metadata
        self.kv_cache.write(layer_idx, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        return paged_attention(
            q, self.kv_cache.keys(layer_idx), self.kv_cache.values(layer_idx), out,
            meta.query_start_loc, meta.seq_lens, meta.block_table, meta.tile_seq,
            meta.tile_q_start, meta.shape, scale=scale, sliding_window=meta.sliding_window,
        )
