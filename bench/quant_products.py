#!/usr/bin/env python3
"""The quantized products against the machine's bounds (issue 32 items 1 and 2).

For one GGUF (default: the 1B-class file bench/make_1b_gguf.py writes),
with ``--threads`` threads, after a quiet moment:

    bandwidth        reading: the best of five sums of 512 MiB (bench/roofline.py;
                     a decode step only reads its weights)
    integer peak     the products' instruction from registers on each thread
                     (``QuantMatmul.int16_peak_macs``: 12 independent VNNI
                     vpdpwssd, or AVX2 madd + add), x the threads, in GOP/s
                     (a multiply-add is two operations)
    one row          each weight role (attn_q, ..., ffn_down, the output
                     head) multiplied by one row, every layer's tensor in
                     turn so no weight is in a cache: GB/s read, % of the
                     bandwidth
    64 rows          the same roles by 64 rows (the batch and prefill
                     path; ``--batch-rows 64,512`` for more sizes): GOP/s,
                     % of the integer peak
    decode step      single-stream decode through the engine (one-call
                     decoder, every default): tokens/s x the weight bytes a
                     step reads = GB/s, % of the bandwidth

    python bench/quant_products.py                      # the 1B-class file
    python bench/quant_products.py --model gemma-3-270m-q4_k_m.gguf --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from roofline import measure_bandwidth
from throughput import uptime, wait_for_quiet

DEFAULT_MODEL = Path.home() / ".cache" / "cadence" / "llama-1b-class" / "llama-1b-class-q4_k_m.gguf"
PEAK_ITERATIONS = 20_000_000
DECODE_TOKENS = 64
BATCH_ROWS = 64


def weight_roles(path: str) -> dict[str, list]:
    """role -> the GGUF's quantized 2-D tensors of that role, one per layer (the output head:
    ``output.weight``, or the tied ``token_embd.weight``)."""
    import gguf

    reader = gguf.GGUFReader(path)
    roles: dict[str, list] = defaultdict(list)
    names = {tensor.name for tensor in reader.tensors}
    head = "output.weight" if "output.weight" in names else "token_embd.weight"
    for tensor in reader.tensors:
        if tensor.tensor_type.name in ("F32", "F16", "BF16") or len(tensor.shape) != 2:
            continue
        if tensor.name.startswith("blk."):
            roles[tensor.name.split(".", 2)[2].removesuffix(".weight")].append(tensor)
        elif tensor.name == head:
            roles["output head"].append(tensor)
    return dict(roles)


def step_bytes(path: str) -> int:
    """Bytes of weights one decode step reads: every tensor but a separate input embedding
    (one row of it is read)."""
    import gguf

    reader = gguf.GGUFReader(path)
    names = {tensor.name for tensor in reader.tensors}
    return sum(int(tensor.n_bytes) for tensor in reader.tensors
               if not (tensor.name == "token_embd.weight" and "output.weight" in names))


def time_products(kernel, tensors: list, rows: int, rounds: int) -> tuple[float, int, int]:
    """Seconds for ``rounds`` passes over ``tensors`` (each x [rows, k] @ W^T), with the bytes
    and multiply-adds of one pass."""
    parts = []
    for tensor in tensors:
        blocks = torch.from_numpy(np.array(tensor.data)).contiguous()
        k = int(tensor.shape[0])
        parts.append((blocks, int(tensor.tensor_type), k, torch.randn(rows, k)))
    for blocks, type_id, k, x in parts:  # warm-up
        kernel.matmul(x, blocks, type_id, k)
    start = time.perf_counter()
    for _ in range(rounds):
        for blocks, type_id, k, x in parts:
            kernel.matmul(x, blocks, type_id, k)
    seconds = time.perf_counter() - start
    num_bytes = sum(blocks.numel() for blocks, *_ in parts)
    macs = sum(rows * blocks.shape[0] * k for blocks, _, k, _ in parts)
    return seconds, num_bytes, macs


def integer_peak_gops(kernel, threads: int) -> float:
    kernel.int16_peak_macs(PEAK_ITERATIONS // 100)
    start = time.perf_counter()
    macs = kernel.int16_peak_macs(PEAK_ITERATIONS)
    return 2 * macs / (time.perf_counter() - start) / 1e9 * threads


def decode_tokens_per_s(path: str, threads: int) -> float:
    from cadence.engine.llm import LLM
    from cadence.sampling_params import SamplingParams

    llm = LLM(model=path, num_threads=threads)
    core = llm.engine.core
    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(1000, 1032))}
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    ends: list[float] = []
    step = core.step
    core.step = lambda: (step(), ends.append(time.perf_counter()))[0]
    llm.generate([prompt], params, use_tqdm=False)
    core.step = step
    return (DECODE_TOKENS - 1) / (ends[DECODE_TOKENS - 1] - ends[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--wait-quiet", type=float, default=120.0, metavar="SECONDS")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--batch-rows", default=str(BATCH_ROWS), metavar="ROWS",
                        help=f"comma list of row counts for the many-row products (default {BATCH_ROWS})")
    args = parser.parse_args()
    batch_rows = [int(rows) for rows in args.batch_rows.split(",")]
    if not Path(args.model).exists():
        print(f"{args.model}: no such file (bench/make_1b_gguf.py writes the 1B-class one)", file=sys.stderr)
        return 1
    from cadence.kernels.quant_matmul import quant_matmul

    torch.set_num_threads(args.threads)
    kernel = quant_matmul()
    if kernel is None:
        print("no C kernel here (no compiler?)", file=sys.stderr)
        return 1
    others = wait_for_quiet(args.wait_quiet)
    report = {"model": os.path.basename(args.model), "threads": args.threads, "kernel": kernel.isa,
              "others busy (cores)": round(others, 2), "uptime": uptime()}
    bandwidth = measure_bandwidth()["read_gbs"]
    peak = integer_peak_gops(kernel, args.threads)
    report |= {"read bandwidth GB/s": round(bandwidth, 1), "integer peak GOP/s": round(peak, 1)}
    print(f"{report['model']}, {args.threads} threads, {kernel.isa}: read bandwidth {bandwidth:.1f} GB/s, "
          f"integer peak {peak:.0f} GOP/s (others busy {others:.2f} cores)")
    print("| role | type | one row GB/s | % of bandwidth | "
          + " | ".join(f"{rows} rows GOP/s | % of peak" for rows in batch_rows) + " |")
    print("|---|---|---:|---:|" + "---:|---:|" * len(batch_rows))
    roles = {}
    for role, tensors in weight_roles(args.model).items():
        seconds, num_bytes, _ = time_products(kernel, tensors, 1, rounds=5)
        one_row = 5 * num_bytes / seconds / 1e9
        kinds = "/".join(sorted({tensor.tensor_type.name for tensor in tensors}))
        roles[role] = {"type": kinds, "one row GB/s": round(one_row, 1)}
        cells = []
        for rows in batch_rows:
            seconds, _, macs = time_products(kernel, tensors[:4], rows, rounds=1)
            batch = 2 * macs / seconds / 1e9
            roles[role][f"{rows} rows GOP/s"] = round(batch, 1)
            cells.append(f"{batch:.0f} | {100 * batch / peak:.0f}%")
        print(f"| {role} | {kinds} | {one_row:.1f} | {100 * one_row / bandwidth:.0f}% | {' | '.join(cells)} |")
    report["roles"] = roles
    tokens_per_s = decode_tokens_per_s(args.model, args.threads)
    read = tokens_per_s * step_bytes(args.model) / 1e9
    report |= {"decode tok/s": round(tokens_per_s, 1), "decode step GB/s": round(read, 1),
               "decode % of bandwidth": round(100 * read / bandwidth, 1)}
    print(f"decode step: {tokens_per_s:.1f} tok/s x {step_bytes(args.model) / 2**20:.0f} MiB = {read:.1f} GB/s, "
          f"{100 * read / bandwidth:.0f}% of the bandwidth")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
