#!/usr/bin/env python3
"""Simulator scale: 100,000 requests of Llama-3-8B on the H100 roofline.

Workload ``sim-scale-v1``: 100,000 requests, Poisson arrivals at 40 req/s
(about three quarters of what the modelled H100 sustains on it), prompts
lognormal mean 512 tokens, outputs lognormal mean 128 (both CV 1, at most
4096), seed 0. Scheduler: 256 sequences, 8192-token budget,
max_model_len 8192, block 16, prefix caching on, FCFS; KV blocks sized by
the H100 profile (90% of 80 GB less the weights).

Figure: wall seconds for the whole simulation (target: under 60 s), with
CPU seconds and microseconds per output token. ``--profile N`` runs N
requests under cProfile and splits the time by package (the real scheduler
in cadence/core against the simulator's own code in cadence/sim).

    python bench/sim_scale.py                          # the figure
    python bench/sim_scale.py --profile 10000          # where the time goes
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cadence.config import CacheConfig, SchedulerConfig  # noqa: E402
from cadence.sim.cost_model import PROFILES, ModelShape, RooflineCostModel  # noqa: E402
from cadence.sim.simulator import Simulator  # noqa: E402
from cadence.sim.workload import SyntheticWorkload  # noqa: E402

WORKLOAD = "sim-scale-v1"
TARGET_S = 60.0
LLAMA_3_8B = {
    "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
    "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
}


def make_workload(num_requests: int, rate: float):
    return SyntheticWorkload(num_requests=num_requests, rate=rate, prompt_len="lognormal:512:1.0",
                             output_len="lognormal:128:1.0", max_len=4096, seed=0).generate()


def make_simulator() -> Simulator:
    cost_model = RooflineCostModel(PROFILES["h100"], ModelShape.from_hf_config(LLAMA_3_8B))
    scheduler_config = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=8192)
    return Simulator(scheduler_config, CacheConfig(block_size=16, enable_prefix_caching=True), cost_model)


def run(num_requests: int, rate: float) -> dict:
    specs = make_workload(num_requests, rate)
    simulator = make_simulator()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    result = simulator.run(specs, label="fcfs")
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    summary = result.summary()
    return {
        "workload": WORKLOAD, "num_requests": num_requests, "rate": rate,
        "wall_s": wall, "cpu_s": cpu, "num_steps": result.num_steps,
        "simulated_s": result.clock_s, "output_tokens": summary["output_tokens"],
        "us_per_output_token": 1e6 * wall / summary["output_tokens"],
        "kv_blocks": simulator.cache_config.num_gpu_blocks,
        "summary": summary,
    }


def profile(num_requests: int, rate: float) -> None:
    specs = make_workload(num_requests, rate)
    simulator = make_simulator()
    profiler = cProfile.Profile()
    profiler.runcall(simulator.run, specs)
    stats = pstats.Stats(profiler)
    by_part: dict[str, float] = defaultdict(float)
    total = 0.0
    for (filename, _, _), (_, _, tottime, _, _) in stats.stats.items():
        by_part[_part(filename)] += tottime
        total += tottime
    print(f"cProfile of {num_requests} requests: {total:.1f} s of own time (profiler overhead included)")
    for part, seconds in sorted(by_part.items(), key=lambda kv: -kv[1]):
        print(f"  {part:<42}{seconds:>8.2f} s {seconds / total:>7.1%}")
    stats.sort_stats("tottime").print_stats(15)


def _part(filename: str) -> str:
    path = filename.replace(os.sep, "/")
    for marker in ("cadence/core/sched/", "cadence/core/kv_cache/", "cadence/core/", "cadence/sim/",
                   "cadence/engine/"):
        if marker in path:
            if marker == "cadence/core/":
                return "cadence/core/" + path.split("cadence/core/")[1]
            return marker
    return "builtins and stdlib" if "<" in path or "/lib/python" in path or path == "~" else path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=100_000)
    parser.add_argument("--rate", type=float, default=40.0, help="arrivals per second")
    parser.add_argument("--profile", type=int, metavar="N", help="profile N requests instead")
    parser.add_argument("--json", metavar="PATH", help="write the figures here")
    args = parser.parse_args()
    if args.profile:
        profile(args.profile, args.rate)
        return 0
    result = run(args.num_requests, args.rate)
    summary = result["summary"]
    print(f"{WORKLOAD}: {args.num_requests} requests of Llama-3-8B on roofline:h100, "
          f"{result['kv_blocks']} KV blocks; Python {platform.python_version()}, {os.cpu_count()} cpus")
    print(f"wall {result['wall_s']:.1f} s (target < {TARGET_S:.0f} s), cpu {result['cpu_s']:.1f} s, "
          f"{result['num_steps']} steps, {result['us_per_output_token']:.2f} us per output token")
    print(f"simulated {result['simulated_s']:.0f} s: {summary['throughput']['output_tokens_per_s']:.0f} "
          f"output tok/s, TTFT p50 {summary['ttft_s']['p50'] * 1e3:.0f} ms p99 "
          f"{summary['ttft_s']['p99'] * 1e3:.0f} ms, TPOT p50 {summary['tpot_s']['p50'] * 1e3:.1f} ms "
          f"p99 {summary['tpot_s']['p99'] * 1e3:.1f} ms, preemptions {summary['preemptions']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
