"""CUDA graphs for decode steps: the whole forward replayed as one launch.

A decode-only step of B requests (one token each, no drafts) runs the
model on B tokens; on a GPU its ~15 kernel launches per layer cost more than
the kernels themselves at small B. ``DecodeGraphs`` captures the forward
once per batch size in ``capture_sizes`` and replays the smallest one that
holds B, the rows past B padded:

    static buffers (fixed addresses, sized for the largest graph)
      input_ids, positions, slot_mapping, seq_lens, block_table, tile lists
    replay(step): copy the step's rows in, pad the rest, replay, return hidden[:B]

A padded row is a one-token sequence at position 0 whose key and value go
to the cache's scratch block (one block past those the scheduler owns), so
it reads and writes nothing a real request uses.
"""

from __future__ import annotations

from typing import Callable

import torch

from cadence.kernels.triton_attention import TileShape
from cadence.runner.gpu_attention import DeviceStep, GpuAttentionMetadata, TritonPagedAttention
from cadence.runner.kv_cache import PagedKVCache


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_num_seqs`` (vLLM's spacing, roughly)."""
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 16, 16))
    return sorted({min(s, max_num_seqs) for s in sizes})


class DecodeGraphs:
    """One captured forward per batch size; ``run`` replays the one that fits."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: PagedKVCache,
        *,
        capture_sizes: list[int],
        max_blocks_per_req: int,
        group: int,
        num_kv_heads: int,
        num_sms: int,
        sliding_window: int | None,
        scratch_block: int,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.capture_sizes = sorted(capture_sizes)
        self.max_size = self.capture_sizes[-1]
        self.scratch_block = scratch_block
        device = kv_cache.data.device
        n = self.max_size
        block_size = kv_cache.block_size
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), scratch_block * block_size, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=device)
        self.block_table = torch.full((n, max_blocks_per_req), scratch_block, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int64, device=device)
        self.tile_seq = torch.arange(n, dtype=torch.int64, device=device)
        self.tile_q_start = torch.zeros(n, dtype=torch.int64, device=device)
        # Per size: small batches split their keys to fill the GPU (as StepStager does).
        self.shapes = {size: TileShape.choose(group, 1, num_tiles=size, num_kv_heads=num_kv_heads,
                                              num_sms=num_sms) for size in self.capture_sizes}
        self.sliding_window = sliding_window
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0

    def can_run(self, num_reqs: int, max_query_len: int) -> bool:
        return max_query_len == 1 and num_reqs <= self.max_size

    def capture(self) -> None:
        """Capture every size, largest first so the smaller ones reuse its memory pool."""
        pool = None
        for size in reversed(self.capture_sizes):
            forward = self._forward_fn(size)
            forward()  # warm-up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = forward()
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def run(self, step: DeviceStep) -> torch.Tensor:
        """Hidden states ``[B, hidden]`` of a decode-only step of B requests."""
        num_reqs = step.input_ids.shape[0]
        size = next(s for s in self.capture_sizes if s >= num_reqs)
        meta = step.attention
        width = meta.block_table.shape[1]
        self.input_ids[:num_reqs].copy_(step.input_ids)
        self.positions[:num_reqs].copy_(step.positions)
        self.slot_mapping[:num_reqs].copy_(meta.slot_mapping)
        self.seq_lens[:num_reqs].copy_(meta.seq_lens)
        self.block_table[:num_reqs, :width].copy_(meta.block_table)
        if num_reqs < size:
            self._pad(num_reqs, size)
        self.graphs[size].replay()
        self.num_replays += 1
        return self.outputs[size][:num_reqs]

    def _pad(self, start: int, end: int) -> None:
        """Rows start..end-1 become scratch sequences (a previous replay may have left real ones)."""
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.slot_mapping[start:end].fill_(self.scratch_block * self.kv_cache.block_size)
        self.seq_lens[start:end].fill_(1)
        self.block_table[start:end].fill_(self.scratch_block)

    def _forward_fn(self, size: int) -> Callable[[], torch.Tensor]:
        metadata = GpuAttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size], block_table=self.block_table[:size],
            tile_seq=self.tile_seq[:size], tile_q_start=self.tile_q_start[:size],
            shape=self.shapes[size], sliding_window=self.sliding_window,
        )
        attention = TritonPagedAttention(self.kv_cache, metadata)
        ids, positions = self.input_ids[:size], self.positions[:size]
        return lambda: self.model(ids, positions, attention)
