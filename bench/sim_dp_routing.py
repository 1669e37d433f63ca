#!/usr/bin/env python3
"""Routing over data-parallel replicas in the simulator: workload ``sim-dp-routing-v1``.

Eight replicas of Llama-3-8B, each on the H100 roofline (its own KV cache of
26,674 blocks of 16 tokens), behind the front end's router
(``cadence.engine.dp_router``) under each policy: round robin, least
loaded, cache aware (the default margin, 8,192 tokens). The trace shares
prefixes: 512 prefix groups (system prompts, documents) of 2,048 tokens,
every request in one of them, then its own tokens (prompts lognormal mean
2,304 tokens, CV 0.1; outputs lognormal mean 128, CV 0.5); Poisson arrivals,
seed 0. The groups' prefixes hold about 1.05 M tokens: more than one
replica's cache (427 k tokens), less than the eight together.

Figures per policy: prefix hit rate (prompt tokens served from the cache),
TTFT p50/p99, TPOT p50, output tokens/s, the requests each replica got
(fewest, most). Only the virtual clock counts; the wall time is the
simulator's own.

    python bench/sim_dp_routing.py                       # two rates, ~10 minutes
    python bench/sim_dp_routing.py --rates 40 --num-requests 2000   # a quick look
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.rate_sweep import sweep_rates  # noqa: E402
from cadence.config import CacheConfig, SchedulerConfig  # noqa: E402
from cadence.sim.cost_model import LLAMA_3_8B, PROFILES, ModelShape, RooflineCostModel  # noqa: E402
from cadence.sim.replicas import compare_routing  # noqa: E402
from cadence.sim.workload import SyntheticWorkload  # noqa: E402

WORKLOAD = "sim-dp-routing-v1"
ROUTINGS = ("round_robin", "least_loaded", "cache_aware")
NUM_REPLICAS = 8


def trace(num_requests: int, rate: float, seed: int):
    return SyntheticWorkload(
        num_requests=num_requests, rate=rate, prompt_len="lognormal:2304:0.1",
        output_len="lognormal:128:0.5", max_len=8192, prefix_groups=512, prefix_fraction=1.0,
        prefix_tokens=2048, seed=seed).generate()


def run(rate: float, args: argparse.Namespace) -> dict[str, dict]:
    cost_model = RooflineCostModel(PROFILES["h100"], ModelShape.from_hf_config(LLAMA_3_8B))
    scheduler = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=8192)
    cache = CacheConfig(block_size=16, num_gpu_blocks=cost_model.num_kv_blocks(16))
    runs = compare_routing(trace(args.num_requests, rate, args.seed), ROUTINGS, NUM_REPLICAS,
                           scheduler, cache, cost_model)
    rows = {}
    for routing, (result, per_replica) in runs.items():
        summary = result.summary()
        rows[routing] = {
            "prefix_hit_rate": summary["prefix_hit_rate"],
            "ttft_p50_s": summary["ttft_s"]["p50"], "ttft_p99_s": summary["ttft_s"]["p99"],
            "tpot_p50_s": summary["tpot_s"]["p50"],
            "output_tokens_per_s": summary["throughput"]["output_tokens_per_s"],
            "num_finished": summary["num_finished"],
            "requests_per_replica": per_replica, "sim_wall_s": result.wall_s,
        }
    return rows


def table(rate: float, rows: dict[str, dict]) -> str:
    base = rows["round_robin"]
    lines = [f"rate {rate:g} req/s",
             "routing        hit rate  TTFT p50  TTFT p99  TPOT p50   out tok/s  per replica  "
             "TTFT p50 vs rr",
             "-------------  --------  --------  --------  --------  ----------  -----------  "
             "--------------"]
    for routing, row in rows.items():
        spread = f"{min(row['requests_per_replica'])}-{max(row['requests_per_replica'])}"
        lines.append(
            f"{routing:<13}  {row['prefix_hit_rate']:8.1%}  {row['ttft_p50_s']:7.3f}s  "
            f"{row['ttft_p99_s']:7.3f}s  {row['tpot_p50_s'] * 1000:6.1f}ms  "
            f"{row['output_tokens_per_s']:10.0f}  {spread:>11}  "
            f"{row['ttft_p50_s'] / base['ttft_p50_s']:13.2f}x")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="40,80", help="arrival rates, req/s, comma separated")
    parser.add_argument("--num-requests", type=int, default=8000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write the figures here")
    args = parser.parse_args()
    print(f"$ python {' '.join(sys.argv)}")
    print(f"{WORKLOAD}: {NUM_REPLICAS} replicas, Llama-3-8B on the h100 roofline; "
          f"{args.num_requests} requests, seed {args.seed}; host {platform.processor() or platform.machine()}")
    sweep_rates(args.rates, lambda rate: run(rate, args), table, WORKLOAD, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
