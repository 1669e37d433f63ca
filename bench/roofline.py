"""The machine's roofline for a whole generation workload.

Two measurements of the machine, with the threads the workload uses:

- memory bandwidth: the best of a large tensor copy (bytes read + written)
  and a large reduction (bytes read);
- matmul throughput: a large square GEMM, per dtype, the best of the two
  libraries PyTorch has on the CPU (``torch.mm``, MKL for float32; oneDNN
  with a packed weight, as cadence's runner uses, only where
  ``packing_works`` says this CPU packs that dtype).

Only what this CPU can do is measured, and what was left out is said: a
dtype the CPU computes in software (bfloat16 without AVX512_BF16, AMX or ARM
BF16: about 1 GFLOP/s on an AVX2 EPYC, where a 4096-square product takes
minutes) is timed on a small matrix and marked emulated; the caller decides
whether to time it at all (``emulated_reason``).

Two costs of the workload, from the model's shape (``ModelConfig``):

- FLOPs: 2 x the matmul weights for every token the model runs (the
  vocabulary projection only where a token is sampled), plus attention
  (QK^T and PV: 4 x Hq x D per query per key, per layer);
- bytes: every forward step reads all weights once (the whole batch shares
  the step) plus the KV cache of every sequence in it.

The workload's bound in output tokens/s is the lesser of the two:

    compute-bound = output tokens / (FLOPs / matmul FLOP/s)
    memory-bound  = output tokens / (bytes / bandwidth)

Both assume one prefill step for all prompts, then one decode step per
further token with every sequence in it, which is how a batch of equal
``max_tokens`` runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from cadence import cpu_features
from cadence.cpu_features import CpuFeatures
from cadence.kernels import packed_weights
from cadence.models.config import ModelConfig
from cadence.runner.cpu_paths import emulation_note

BANDWIDTH_BYTES = 512 * 2**20  # per buffer: far beyond any cache
GEMM_SIZE = 4096
# Emulated bfloat16 runs ~1 GFLOP/s: 512 squared is ~0.3 s a product, and
# still large enough that the time is the arithmetic, not the call.
EMULATED_GEMM_SIZE = 512


# ---------------------------------------------------------------- the machine


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: page faults, kernel selection
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(num_bytes: int = BANDWIDTH_BYTES, repeats: int = 5) -> dict[str, float]:
    """GB/s of a tensor copy (read + write counted) and of a sum (read only)."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_s = best_seconds(lambda: dst.copy_(src), repeats)
    read_s = best_seconds(lambda: src.sum(), repeats)
    copy_gbs = 2 * num_bytes / copy_s / 1e9
    read_gbs = num_bytes / read_s / 1e9
    return {"copy_gbs": copy_gbs, "read_gbs": read_gbs, "bandwidth_gbs": max(copy_gbs, read_gbs)}


def emulated_reason(dtype: torch.dtype, features: CpuFeatures | None = None) -> str | None:
    """Why ``dtype`` is computed in software on this CPU (as ``features`` shows it), or None."""
    return emulation_note(dtype, cpu_features.detect() if features is None else features)


def gemm_size(dtype: torch.dtype, features: CpuFeatures | None = None) -> int:
    """The matrix side to time ``dtype`` at: small where it is emulated, so it ends in seconds."""
    return EMULATED_GEMM_SIZE if emulated_reason(dtype, features) else GEMM_SIZE


def measure_gemm(dtype: torch.dtype, size: int | None = None, repeats: int = 3) -> dict:
    """GFLOP/s of a square matmul in ``dtype``, the faster library's, and what was left out.

    The packed oneDNN product is timed only where ``packing_works(dtype)``;
    elsewhere (bfloat16 without AVX-512 BW/VL/DQ or AVX-NE-CONVERT, where
    oneDNN's reorder raises; oneDNN hidden) ``packed_skipped`` says why not.
    """
    features = cpu_features.detect()
    size = gemm_size(dtype, features) if size is None else size
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    seconds, library, skipped = best_seconds(lambda: torch.mm(a, b), repeats), "torch.mm", None
    if packed_weights.packing_works(dtype, features):
        packed = packed_weights.pack(b)  # a @ b.T: the same FLOPs
        packed_s = best_seconds(lambda: packed_weights.packed_linear(a, packed, None), repeats)
        seconds, library = min((seconds, library), (packed_s, "oneDNN packed"))
    else:
        skipped = packed_weights.why_not_packed(dtype, features)
    return {"gflops": 2 * size**3 / seconds / 1e9, "size": size, "library": library,
            "emulated": emulated_reason(dtype, features), "packed_skipped": skipped}


# ---------------------------------------------------------------- the workload


@dataclass(frozen=True)
class WorkloadCost:
    """FLOPs and bytes of one whole run, and the output tokens it makes."""

    flops: float
    bytes: float
    num_output_tokens: int
    weight_bytes_per_step: float
    kv_bytes_read: float

    def bound(self, gflops: float, bandwidth_gbs: float) -> dict[str, float]:
        """Output tokens/s if compute alone, or memory alone, set the pace; and the lesser."""
        compute = self.num_output_tokens / (self.flops / (gflops * 1e9))
        memory = self.num_output_tokens / (self.bytes / (bandwidth_gbs * 1e9))
        return {"compute_tok_s": compute, "memory_tok_s": memory, "roofline_tok_s": min(compute, memory)}


def layer_weight_count(config: ModelConfig) -> int:
    """Matmul weights of one decoder layer (norms are negligible)."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q_and_o = 2 * hidden * config.num_attention_heads * head_dim
    k_and_v = 2 * hidden * config.num_key_value_heads * head_dim
    mlp = 3 * hidden * config.intermediate_size
    return q_and_o + k_and_v + mlp


def workload_cost(
    config: ModelConfig, prompt_lens: list[int], max_tokens: int, dtype: torch.dtype
) -> WorkloadCost:
    """The cost of generating ``max_tokens`` after each prompt, all in one batch.

    Step 0 prefills every prompt and samples token 1; steps 1..max_tokens-1
    each feed the last token of every sequence, whose context is then
    prompt_len + step tokens long.
    """
    itemsize = dtype.itemsize
    num_layers = config.num_hidden_layers
    layer_weights = num_layers * layer_weight_count(config)
    lm_head = config.vocab_size * config.hidden_size
    num_seqs = len(prompt_lens)
    num_output = num_seqs * max_tokens
    num_forward = sum(prompt_lens) + num_seqs * (max_tokens - 1)
    # Keys seen by every query, summed: causal prefill, then one query per decode step.
    keys_prefill = sum(p * (p + 1) // 2 for p in prompt_lens)
    context_decode = sum(p * (max_tokens - 1) + max_tokens * (max_tokens - 1) // 2 for p in prompt_lens)
    attention_flops = 4 * config.num_attention_heads * config.head_dim * num_layers
    flops = (
        2 * layer_weights * num_forward
        + 2 * lm_head * num_output
        + attention_flops * (keys_prefill + context_decode)
    )
    kv_per_token = 2 * num_layers * config.num_key_value_heads * config.head_dim * itemsize
    weight_bytes = (layer_weights + lm_head) * itemsize
    kv_read = kv_per_token * (sum(prompt_lens) + context_decode)
    return WorkloadCost(
        flops=float(flops),
        bytes=float(max_tokens * weight_bytes + kv_read),
        num_output_tokens=num_output,
        weight_bytes_per_step=float(weight_bytes),
        kv_bytes_read=float(kv_read),
    )
