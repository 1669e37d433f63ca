#!/usr/bin/env python3
"""Prefill/decode disaggregation in the simulator: workload ``sim-pd-v1``.

Two H100s serving Llama-3-8B (the H100 roofline, each GPU its own KV cache
of 26,674 blocks of 16 tokens), used two ways on the same trace:

- ``dp 2``: two data-parallel replicas behind the least-loaded router, each
  prefilling and decoding its own requests;
- ``pd 1P1D <link>``: one prefill and one decode replica
  (``cadence.sim.disaggregation``, the real PDConnector scheduler side on
  both), the prompt's KV pulled over pcie (32 GB/s), nvlink (450 GB/s) or
  ethernet-100g (12.5 GB/s), no per-pull latency.

The trace: prompts uniform in [1024, 4096] tokens, outputs uniform in
[128, 512], Poisson arrivals, seed 0. Figures per run: TTFT p50/p90 (to the
decode replica's first token), TPOT p50/p90, E2E p50, output tokens/s, the
pulls' total seconds on the link, and each P/D run over dp 2. Only the
virtual clock counts; the wall time is the simulator's own.

    python bench/pd_sim.py                                  # three rates, ~1 minute
    python bench/pd_sim.py --rates 8 --num-requests 40      # a quick look
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.rate_sweep import sweep_rates  # noqa: E402
from cadence.config import CacheConfig, SchedulerConfig  # noqa: E402
from cadence.sim.cost_model import make_cost_model  # noqa: E402
from cadence.sim.disaggregation import compare_pd  # noqa: E402
from cadence.sim.workload import SyntheticWorkload  # noqa: E402

WORKLOAD = "sim-pd-v1"
LINKS = ("pcie", "nvlink", "ethernet-100g")


def run(rate: float, args: argparse.Namespace) -> dict[str, dict]:
    cost_model = make_cost_model("roofline:h100")  # Llama-3-8B
    scheduler = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=8192)
    cache = CacheConfig(block_size=16, num_gpu_blocks=cost_model.num_kv_blocks(16))
    specs = SyntheticWorkload(num_requests=args.num_requests, rate=rate, prompt_len="uniform:1024:4096",
                              output_len="uniform:128:512", seed=args.seed).generate()
    runs = compare_pd(specs, 1, 1, args.links.split(","), scheduler, cache, cost_model)
    rows = {}
    for label, result in runs.items():
        summary = result.summary()
        rows[label] = {
            "num_finished": summary["num_finished"],
            "ttft_p50_s": summary["ttft_s"]["p50"], "ttft_p90_s": summary["ttft_s"]["p90"],
            "tpot_p50_s": summary["tpot_s"]["p50"], "tpot_p90_s": summary["tpot_s"]["p90"],
            "e2e_p50_s": summary["e2e_s"]["p50"],
            "output_tokens_per_s": summary["throughput"]["output_tokens_per_s"],
            "transfer_s": summary.get("transfers", {}).get("seconds", 0.0),
            "transfer_gb": summary.get("transfers", {}).get("bytes", 0) / 1e9,
            "link_wait_s": summary.get("transfers", {}).get("link_wait_s", 0.0),
            "preemptions": summary["preemptions"], "sim_wall_s": result.wall_s,
        }
    return rows


def table(rate: float, rows: dict[str, dict]) -> str:
    base = rows["dp 2"]
    lines = [f"rate {rate:g} req/s",
             "run                    done  TTFT p50  TTFT p90  TPOT p50  TPOT p90  E2E p50  out tok/s"
             "  pulls (GB, s, wait s)   TTFT p50  TPOT p50  tok/s  (vs dp 2)",
             "---------------------  ----  --------  --------  --------  --------  -------  ---------"
             "  ---------------------   --------  --------  -----"]
    for label, row in rows.items():
        pulls = (f"{row['transfer_gb']:6.1f} {row['transfer_s']:6.2f} {row['link_wait_s']:6.2f}"
                 if label != "dp 2" else "")
        lines.append(
            f"{label:<21}  {row['num_finished']:4d}  {row['ttft_p50_s']:7.3f}s  {row['ttft_p90_s']:7.3f}s  "
            f"{row['tpot_p50_s'] * 1000:6.1f}ms  {row['tpot_p90_s'] * 1000:6.1f}ms  {row['e2e_p50_s']:6.2f}s  "
            f"{row['output_tokens_per_s']:9.0f}  {pulls:<21}   "
            f"{row['ttft_p50_s'] / base['ttft_p50_s']:7.2f}x  {row['tpot_p50_s'] / base['tpot_p50_s']:7.2f}x  "
            f"{row['output_tokens_per_s'] / base['output_tokens_per_s']:4.2f}x")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="4,8,12", help="arrival rates, req/s, comma separated")
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--links", default=",".join(LINKS), help="P/D links, comma separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write the figures here")
    args = parser.parse_args()
    print(f"$ python {' '.join(sys.argv)}")
    print(f"{WORKLOAD}: 2 x H100 roofline, Llama-3-8B; dp 2 vs 1 prefill + 1 decode; "
          f"{args.num_requests} requests, prompts 1024-4096, outputs 128-512, seed {args.seed}; "
          f"host {platform.processor() or platform.machine()} (virtual clock)")
    sweep_rates(args.rates, lambda rate: run(rate, args), table, WORKLOAD, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
