#!/usr/bin/env python3
"""Scheduler CPU time per step: workload ``sched-overhead-v1``.

Defined in ../shared/workloads/README.md (and run the same way on vLLM by
../shared/peers/vllm/vllm_sched_bench.py). N requests are added before the
first step; the fake runner of ``cadence.core.testing`` samples token 7
whenever a request's scheduled tokens reach the end of its known tokens. Time inside
``schedule()`` and ``update_from_output()`` is measured with perf_counter_ns
(the runner excluded); each figure is the median of 3 runs.

    python bench/sched_overhead.py                 # the whole table
    python bench/sched_overhead.py -n 256 --json   # one row, JSON
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass

from cadence.config import CacheConfig, SchedulerConfig
from cadence.core.request import Request
from cadence.core.sched.scheduler import Scheduler
from cadence.core.testing import FakeRunner, fixed_token
from cadence.sampling_params import SamplingParams

WORKLOAD = "sched-overhead-v1"
SAMPLED_TOKEN = 7
MAX_TOKENS = 128
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Variant:
    label: str
    num_requests: int
    prefix_caching: bool
    shared_prefix: bool = False
    blocks_fraction: float | None = None  # None: enough blocks for everything


VARIANTS = [
    Variant("N=64", 64, True),
    Variant("N=64", 64, False),
    Variant("N=256", 256, True),
    Variant("N=256", 256, False),
    Variant("N=1024", 1024, True),
    Variant("N=1024", 1024, False),
    Variant("preempt (N=256, 40% blocks)", 256, True, blocks_fraction=0.4),
    Variant("shared-prefix (N=256)", 256, True, shared_prefix=True),
]


def make_prompts(num_requests: int, shared_prefix: bool, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    if shared_prefix:
        prefix = [rng.randrange(100, 30000) for _ in range(512)]
        return [
            prefix + [rng.randrange(100, 30000) for _ in range(rng.randint(0, 512))]
            for _ in range(num_requests)
        ]
    prompts = []
    for _ in range(num_requests):
        prompt_len = rng.randint(256, 1024)
        prompts.append([rng.randrange(100, 30000) for _ in range(prompt_len)])
    return prompts


def blocks_needed(prompts: list[list[int]]) -> int:
    return sum(-(-(len(p) + MAX_TOKENS) // BLOCK_SIZE) for p in prompts)


def run_once(variant: Variant, prompts: list[list[int]], num_blocks: int) -> dict:
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=variant.num_requests,
            max_num_batched_tokens=8192,
            max_model_len=4096,
            enable_chunked_prefill=True,
        ),
        CacheConfig(
            block_size=BLOCK_SIZE, num_gpu_blocks=num_blocks,
            enable_prefix_caching=variant.prefix_caching,
        ),
        log_stats=True,
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
    arrival = time.time()
    for i, prompt in enumerate(prompts):
        scheduler.add_request(Request(f"req-{i}", prompt, params, arrival_time=arrival))
    runner = FakeRunner(fixed_token(SAMPLED_TOKEN))
    gc.collect()
    gc.freeze()
    clock = time.perf_counter_ns
    cpu_clock = time.thread_time_ns  # this thread's CPU time: less inflated by other load
    sched_ns = update_ns = steps = generated = scheduled_reqs = preemptions = 0
    cpu_ns = 0
    hits = queries = 0
    while scheduler.has_requests():
        c0, t0 = cpu_clock(), clock()
        so = scheduler.schedule()
        t1, c1 = clock(), cpu_clock()
        runner_output = runner.execute_model(so)
        c2, t2 = cpu_clock(), clock()
        outputs = scheduler.update_from_output(so, runner_output)
        t3, c3 = clock(), cpu_clock()
        cpu_ns += (c1 - c0) + (c3 - c2)
        sched_ns += t1 - t0
        update_ns += t3 - t2
        steps += 1
        scheduled_reqs += len(so.num_scheduled_tokens)
        preemptions += len(so.preempted_req_ids)
        generated += sum(len(t) for t in runner_output.sampled_token_ids)
        for eco in outputs.values():
            stats = eco.scheduler_stats
            if stats is not None:
                hits += stats.prefix_cache_stats.hits
                queries += stats.prefix_cache_stats.queries
    gc.unfreeze()
    if generated != len(prompts) * MAX_TOKENS:
        raise RuntimeError(f"generated {generated} tokens, expected {len(prompts) * MAX_TOKENS}")
    return {
        "steps": steps,
        "sched_us_per_step": sched_ns / steps / 1e3,
        "update_us_per_step": update_ns / steps / 1e3,
        "total_us_per_step": (sched_ns + update_ns) / steps / 1e3,
        "us_per_gen_token": (sched_ns + update_ns) / generated / 1e3,
        "cpu_total_us_per_step": cpu_ns / steps / 1e3,
        "ns_per_scheduled_req": (sched_ns + update_ns) / scheduled_reqs,
        "cpu_ns_per_scheduled_req": cpu_ns / scheduled_reqs,
        "preemptions": preemptions,
        "prefix_hit_rate": hits / queries if queries else 0.0,
    }


def run_variant(variant: Variant, repeats: int) -> dict:
    prompts = make_prompts(variant.num_requests, variant.shared_prefix)
    need = blocks_needed(prompts)
    if variant.blocks_fraction is not None:
        num_blocks = int(variant.blocks_fraction * need)
    else:
        num_blocks = need + 1  # same count as the vLLM harness (vLLM keeps a null block)
    runs = [run_once(variant, prompts, num_blocks) for _ in range(repeats)]
    median = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    return {"workload": WORKLOAD, "variant": variant.label, "N": variant.num_requests,
            "prefix_caching": variant.prefix_caching, "num_gpu_blocks": num_blocks, **median}


def print_table(rows: list[dict]) -> None:
    print(f"# {WORKLOAD} — cadence scheduler, median of runs; python {platform.python_version()}")
    header = ("variant", "prefix cache", "schedule µs/step", "update µs/step", "total µs/step",
              "µs/gen token", "ns/sched req", "CPU µs/step", "steps", "preemptions", "hit rate")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print(
            f"| {r['variant']} | {'on' if r['prefix_caching'] else 'off'} "
            f"| {r['sched_us_per_step']:.0f} | {r['update_us_per_step']:.0f} "
            f"| {r['total_us_per_step']:.0f} | {r['us_per_gen_token']:.2f} "
            f"| {r['ns_per_scheduled_req']:.0f} | {r['cpu_total_us_per_step']:.0f} "
            f"| {r['steps']:.0f} | {r['preemptions']:.0f} "
            f"| {r['prefix_hit_rate']:.0%} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-n", "--num-requests", type=int, help="run only the rows with this N")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    parser.add_argument("--quick", action="store_true", help="N=64 rows only, one repeat (a demo)")
    args = parser.parse_args()
    variants = VARIANTS
    if args.quick:
        variants, args.repeats = [v for v in VARIANTS if v.num_requests == 64], 1
    elif args.num_requests is not None:
        variants = [v for v in VARIANTS if v.num_requests == args.num_requests]
    run_once(Variant("warmup", 16, True), make_prompts(16, False, seed=1), 10_000)
    rows = [run_variant(v, args.repeats) for v in variants]
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
