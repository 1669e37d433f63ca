"""How many KV blocks fit on the GPU, vLLM's way: ``--gpu-memory-utilization``.

The engine may use ``utilization x total`` of the GPU's memory. What is not
KV cache is measured, not guessed:

    budget = utilization * total
             - peak memory PyTorch allocated in a profile run of the largest step
               (weights + activations + logits)
             - memory outside PyTorch's allocator (CUDA context, cuBLAS
               workspaces, other processes on the same GPU)
    blocks = budget // bytes per block (all layers, keys and values)

CUDA graphs are captured after the cache is allocated; their pool comes out
of the headroom left by ``1 - utilization``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cadence.runner.kv_cache import bytes_per_block

if TYPE_CHECKING:
    from cadence.runner.model_runner import ModelRunner


def gpu_kv_cache_bytes(
    runner: "ModelRunner", utilization: float, *, max_num_batched_tokens: int, max_num_seqs: int
) -> tuple[int, dict[str, int]]:
    """Bytes left for the KV cache, and the figures it came from (for the log)."""
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    runner.profile_run(max_num_batched_tokens, max_num_seqs)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    budget = int(utilization * total) - peak - outside_torch
    figures = {"total": total, "peak_torch": peak, "outside_torch": outside_torch}
    return budget, figures


def gpu_kv_blocks(
    runner: "ModelRunner", utilization: float, *, max_num_batched_tokens: int, max_num_seqs: int
) -> tuple[int, dict[str, int]]:
    """Whole KV blocks in the budget (0 when not even one fits)."""
    budget, figures = gpu_kv_cache_bytes(
        runner, utilization, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
    block = bytes_per_block(runner.model_config, runner.block_size, runner.kv_cache_dtype)
    return max(0, budget // block), figures
