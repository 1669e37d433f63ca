#!/usr/bin/env python3
"""Cache-aware order in the simulator: fcfs, plain lpm and bounded lpm around capacity (issue 36).

The workload (``lpm-v1``) is chat: a few shared system prompts, multi-turn
conversations (a later turn's prompt is the whole conversation so far, sent a
think time after the previous answer; ``cadence.sim.conversations``). For
each cost model and each seed (a seed is a trace):

1. capacity: the highest arrival rate at which FCFS keeps p99 TTFT <= 2 s,
   found by bisection over the rate on that trace (a Poisson trace scales
   exactly with the rate);
2. at 0.8x, 1.0x and 1.2x of it, the same trace under ``fcfs``, plain
   ``lpm`` (``lpm_max_bypass`` 10**9: no bound, as SGLang ships it) and
   bounded ``lpm`` (the default bound, 16, with ageing): prefix hit rate,
   output tokens/s, TTFT p50/p99, one markdown table per seed;
3. the targets for bounded lpm at every load (throughput >= plain lpm's,
   p99 TTFT <= fcfs's), and over all seeds the ratios behind them.

Two cost models: the H100 roofline with Llama-3-8B (``roofline:h100``), and
the calibrated CPU profile (``bench/results/cpu_calibrated.json``:
SmolLM2-135M on a 2-core EPYC, float32), each at its own scale (the
workloads are in ``PROFILES``).

    python bench/lpm_sweep.py                         # both profiles, 3 seeds: ~3-4 minutes
    python bench/lpm_sweep.py --profile cpu --seeds 1 --bounds 8,32
    python bench/lpm_sweep.py --real --profile "" --wait-quiet 600   # the real engine only (~5 minutes)

``--bounds``: other bounds beside the default (rows "lpm bound N").
``--real``: the real engine (the default model on this CPU) replays a short
trace of the CPU workload at one load under the three policies, in real
time, through the simulator's own loop and metrics (``drive``, a wall
clock); the calibrated profile simulates the same trace beside it, so the
two rankings can be compared. A short run needs a smaller cache and a
higher rate than the sweep for the policies to part (``REAL_*`` below).
Real timings need a quiet machine: ``--wait-quiet S`` waits up to S seconds
for a 1-minute load average under 1.5 (and skips the real runs if it never
falls); the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cadence.config import CacheConfig, SchedulerConfig  # noqa: E402
from cadence.sim.cost_model import make_cost_model  # noqa: E402
from cadence.sim.simulator import Simulator  # noqa: E402
from cadence.sim.workload import SyntheticWorkload  # noqa: E402

WORKLOAD = "lpm-v1"
TTFT_P99_LIMIT_S = 2.0
LOADS = (0.8, 1.0, 1.2)
UNBOUNDED = 10**9
# label -> (policy, its options)
POLICIES = {
    "fcfs": ("fcfs", {}),
    "lpm plain": ("lpm", {"lpm_max_bypass": UNBOUNDED}),
    "lpm bounded": ("lpm", {}),  # the default bound (16), with ageing
}
PROPOSED = "lpm bounded"
CPU_CALIBRATION = Path(__file__).resolve().parent / "results" / "cpu_calibrated.json"


@dataclass(frozen=True)
class Profile:
    """A cost model and the workload at its scale."""

    cost_model: str
    workload: dict[str, Any]
    scheduler: dict[str, Any]
    first_rate: float  # where the capacity search starts
    model_config: str | None = None
    cache: dict[str, Any] = field(default_factory=dict)


PROFILES = {
    # Llama-3-8B on the H100 roofline: 26,674 KV blocks (~427k tokens), 256
    # sequences, a 2,048-token budget. 8 system prompts of 1,024 tokens; a first
    # message of ~256 tokens, later messages ~128, answers ~256; 1-8 turns,
    # 5 s of thinking between them.
    "h100": Profile(
        cost_model="roofline:h100", model_config="llama-3-8b",
        workload=dict(num_requests=4000, prefix_groups=8, prefix_fraction=1.0, prefix_tokens=1024,
                      prompt_len="lognormal:1280:0.3", turn_prompt_len="lognormal:128:1.0",
                      output_len="lognormal:256:1.0", turns="uniform:1:8", think_time="exponential:5",
                      max_len=6000),
        scheduler=dict(max_model_len=8192), first_rate=30.0),
    # SmolLM2-135M on this CPU (calibrated): 1,456 KV blocks (~23k tokens), 64
    # sequences, a 512-token budget. 4 system prompts of 256 tokens; a first
    # message of ~64, later ones ~48, answers ~64; 1-8 turns, 5 s of thinking.
    "cpu": Profile(
        cost_model=f"calibrated:{CPU_CALIBRATION}",
        workload=dict(num_requests=2000, prefix_groups=4, prefix_fraction=1.0, prefix_tokens=256,
                      prompt_len="lognormal:320:0.3", turn_prompt_len="lognormal:48:1.0",
                      output_len="lognormal:64:1.0", turns="uniform:1:8", think_time="exponential:5",
                      max_len=1800),
        scheduler=dict(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=2048), first_rate=2.0),
}


def specs_at(profile: Profile, rate: float, seed: int = 0) -> list:
    return SyntheticWorkload(rate=rate, seed=seed, **profile.workload).generate()


def simulate(profile: Profile, specs: list, label: str) -> dict[str, Any]:
    policy, options = POLICIES[label]
    config = SchedulerConfig(policy=policy, **profile.scheduler, **options)
    cost_model = make_cost_model(profile.cost_model, profile.model_config)
    result = Simulator(config, CacheConfig(**profile.cache), cost_model).run(specs, label=label)
    return result.summary()


def fcfs_ttft_p99(profile: Profile, rate: float, seed: int) -> float:
    return simulate(profile, specs_at(profile, rate, seed), "fcfs")["ttft_s"]["p99"]


def find_capacity(profile: Profile, seed: int, precision: float = 0.02, log=print) -> float:
    """The highest rate with FCFS p99 TTFT <= the limit: bracket by doubling or
    halving from ``first_rate``, then bisect until the bracket is within ``precision``."""
    def ok(rate: float) -> bool:
        p99 = fcfs_ttft_p99(profile, rate, seed)
        log(f"  fcfs at {rate:.3f} req/s: TTFT p99 {p99:.2f} s")
        return p99 <= TTFT_P99_LIMIT_S

    rate = profile.first_rate
    if ok(rate):
        low, high = rate, None
        while high is None:
            rate *= 2
            low, high = (rate, None) if ok(rate) else (low, rate)
    else:
        low, high = None, rate
        while low is None:
            rate /= 2
            low, high = (rate, high) if ok(rate) else (None, rate)
    while high / low > 1 + precision:
        mid = (low * high) ** 0.5
        low, high = (mid, high) if ok(mid) else (low, mid)
    return low


def run_profile(name: str, seed: int, labels: list[str], log=print) -> dict[str, Any]:
    """One trace of a profile: its capacity, then every policy at every load."""
    profile = PROFILES[name]
    start = time.perf_counter()
    log(f"{name}, seed {seed}: finding capacity ...")
    capacity = find_capacity(profile, seed, log=log)
    rows = []
    for load in LOADS:
        rate = load * capacity
        specs = specs_at(profile, rate, seed)
        for label in labels:
            summary = simulate(profile, specs, label)
            rows.append({"load": load, "rate": rate, "policy": label, "summary": _short(summary)})
            log(f"  {load:.1f}x {label}: {_cells(rows[-1])}")
    return {"profile": name, "seed": seed, "capacity_req_s": capacity, "rows": rows,
            "wall_s": time.perf_counter() - start}


def _short(summary: dict[str, Any]) -> dict[str, Any]:
    return {"prefix_hit_rate": summary["prefix_hit_rate"],
            "output_tokens_per_s": summary["throughput"]["output_tokens_per_s"],
            "requests_per_s": summary["throughput"]["requests_per_s"],
            "ttft_p50_s": summary["ttft_s"]["p50"], "ttft_p99_s": summary["ttft_s"]["p99"],
            "tpot_p50_s": summary["tpot_s"]["p50"], "preemptions": summary.get("preemptions"),
            "num_finished": summary["num_finished"], "num_requests": summary["num_requests"]}


def _cells(row: dict[str, Any]) -> str:
    s = row["summary"]
    return (f"hit {s['prefix_hit_rate']:.1%}, {s['output_tokens_per_s']:,.1f} tok/s, "
            f"TTFT p50 {s['ttft_p50_s']:.3f} s, p99 {s['ttft_p99_s']:.2f} s")


def ratios(rows: list[dict[str, Any]], label: str) -> dict[float, dict[str, float]]:
    """Per load: ``label``'s throughput over plain lpm's, its p99 TTFT over fcfs's."""
    by = {(r["load"], r["policy"]): r["summary"] for r in rows}
    return {load: {"throughput / plain lpm": by[(load, label)]["output_tokens_per_s"]
                   / by[(load, "lpm plain")]["output_tokens_per_s"],
                   "p99 TTFT / fcfs": by[(load, label)]["ttft_p99_s"] / by[(load, "fcfs")]["ttft_p99_s"]}
            for load in sorted({r["load"] for r in rows})}


def met(ratio: dict[str, float]) -> dict[str, bool]:
    return {"throughput >= plain lpm": ratio["throughput / plain lpm"] >= 1.0,
            "p99 TTFT <= fcfs": ratio["p99 TTFT / fcfs"] <= 1.0}


def markdown(result: dict[str, Any], cost_model: str) -> str:
    lines = [f"{result['profile']} ({cost_model}), seed {result['seed']}: capacity "
             f"{result['capacity_req_s']:.3f} req/s (FCFS p99 TTFT <= {TTFT_P99_LIMIT_S:g} s)", "",
             "| load | rate (req/s) | policy | prefix hit rate | output tok/s | TTFT p50 (s) | TTFT p99 (s) |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for row in result["rows"]:
        s = row["summary"]
        lines.append(f"| {row['load']:.1f}x | {row['rate']:.3f} | {row['policy']} | {s['prefix_hit_rate']:.1%} "
                     f"| {s['output_tokens_per_s']:,.1f} | {s['ttft_p50_s']:.3f} | {s['ttft_p99_s']:.3f} |")
    lines.append("")
    for load, ratio in ratios(result["rows"], PROPOSED).items():
        lines.append(f"- {load:.1f}x, {PROPOSED}: " + ", ".join(
            f"{name}: {'yes' if ok else 'NO'}" for name, ok in met(ratio).items()))
    return "\n".join(lines)


def summary_markdown(results: list[dict[str, Any]], labels: list[str]) -> str:
    """Over every trace: each bounded policy's ratios (geometric means, worst) and targets met."""
    lines = ["| profile | load | policy | throughput / plain lpm (gmean, min) | p99 TTFT / fcfs (gmean, max) "
             "| throughput >= plain | p99 <= fcfs |", "|---|---|---|---:|---:|---:|---:|"]
    for name in dict.fromkeys(r["profile"] for r in results):
        traces = [r for r in results if r["profile"] == name]
        for load in LOADS:
            for label in (lb for lb in labels if lb.startswith("lpm b")):
                per_trace = [ratios(r["rows"], label)[load] for r in traces]
                thr = [x["throughput / plain lpm"] for x in per_trace]
                p99 = [x["p99 TTFT / fcfs"] for x in per_trace]
                lines.append(f"| {name} | {load:.1f}x | {label} | {_gmean(thr):.4f}, {min(thr):.4f} "
                             f"| {_gmean(p99):.3f}, {max(p99):.3f} | {sum(t >= 1 for t in thr)}/{len(thr)} "
                             f"| {sum(p <= 1 for p in p99)}/{len(p99)} |")
    return "\n".join(lines)


def _gmean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


# ---------------------------------------------------------------- the real engine


# The real run's trace: the CPU workload with shorter conversations, so that each
# policy's replay takes about a minute (its last conversations end soon after its
# last arrivals); the simulation beside it replays the same trace. A minute is too
# short for the CPU profile's overload (its cache of 1,456 blocks thrashes after
# minutes at 1.2x capacity), so the real run's cache is smaller (REAL_KV_BLOCKS)
# and its rate higher: 150 requests at 6 req/s on 400 blocks separate the
# policies in the simulator within 80 s.
REAL_WORKLOAD = dict(turns="uniform:1:4", think_time="exponential:2")
REAL_KV_BLOCKS = 400
REAL_RATE = 6.0
REAL_REQUESTS = 150
QUIET_LOAD = 1.5


def real_runs(rate: float, num_requests: int, num_blocks: int, seed: int, num_threads: int,
              labels: list[str], log=print) -> dict[str, Any]:
    """The CPU workload's trace of ``num_requests`` at ``rate`` on the real
    engine with ``num_blocks`` KV blocks, then simulated on the calibrated
    profile (the same blocks), under each policy."""
    from cadence.core.sched.scheduler import Scheduler
    from cadence.engine.core import EngineCore
    from cadence.sim.calibrate import build_default_engine
    from cadence.sim.metrics import MetricsRecorder, summarize
    from cadence.sim.simulator import RequestFactory, WallClock, drive
    from cadence.sim.workload import PromptMaker

    profile = PROFILES["cpu"]
    cost_model = make_cost_model(profile.cost_model)
    engine = build_default_engine(dtype="float32", num_threads=num_threads, num_gpu_blocks=num_blocks)
    specs = SyntheticWorkload(rate=rate, seed=seed, **{**profile.workload, **REAL_WORKLOAD,
                                                        "num_requests": num_requests}).generate()
    eos = engine.tokenizer.eos_token_ids[0] if engine.tokenizer.eos_token_ids else None
    vocab = engine.model_config.vocab_size
    cache = engine.options.cache
    scheduler_options = {**profile.scheduler, "max_model_len": min(profile.scheduler["max_model_len"],
                                                                    engine.max_model_len)}
    result: dict[str, Any] = {"rate": rate, "num_requests": num_requests, "num_threads": num_threads,
                              "num_gpu_blocks": cache.num_gpu_blocks, "kv_cache_dtype": cache.kv_cache_dtype,
                              "workload": {**profile.workload, **REAL_WORKLOAD, "num_requests": num_requests},
                              "seed": seed,
                              "load_average_before": os.getloadavg(), "real": {}, "sim": {}}

    def replay(config: SchedulerConfig, trace: list) -> dict[str, Any]:
        scheduler = Scheduler(config, cache)
        recorder = MetricsRecorder(trace)
        factory = RequestFactory(PromptMaker(vocab, seed=seed), config.max_model_len, eos_token_id=eos)
        drive(EngineCore(scheduler, engine.core.runner), trace, factory, WallClock(), recorder)
        return summarize(recorder, num_preemptions=scheduler.num_preemptions_total)

    # The first steps pay for allocation and kernel selection: a throwaway replay first.
    replay(SchedulerConfig(**scheduler_options),
           SyntheticWorkload(num_requests=8, rate=0, prompt_len="fixed:256", output_len="fixed:16").generate())
    for label in labels:
        policy, options = POLICIES[label]
        config = SchedulerConfig(policy=policy, **scheduler_options, **options)
        start = time.perf_counter()
        result["real"][label] = _short(replay(config, specs))
        log(f"  real {label} ({time.perf_counter() - start:.0f} s): {_cells({'summary': result['real'][label]})}")
        # The same number of blocks (the cost model prices steps, whatever the cache's dtype).
        sim_cache = dataclasses.replace(cache, kv_cache_dtype="auto")
        sim = Simulator(config, sim_cache, cost_model, prompt_maker=PromptMaker(vocab, seed=seed)).run(specs, label)
        result["sim"][label] = _short(sim.summary())
        log(f"  sim  {label}: {_cells({'summary': result['sim'][label]})}")
    result["load_average_after"] = os.getloadavg()
    return result


def _wait_quiet(max_wait_s: float, log) -> bool:
    """Whether the load average fell under QUIET_LOAD within ``max_wait_s``."""
    deadline = time.monotonic() + max_wait_s
    while os.getloadavg()[0] >= QUIET_LOAD and time.monotonic() < deadline:
        time.sleep(10)
    log(f"load average {os.getloadavg()[0]:.2f} (quiet: under {QUIET_LOAD})")
    return os.getloadavg()[0] < QUIET_LOAD


def real_markdown(result: dict[str, Any]) -> str:
    lines = [f"real engine on this CPU at {result['rate']:.2f} req/s, {result['num_requests']} requests, "
             f"{result['num_threads']} threads, {result['num_gpu_blocks']} KV blocks "
             f"({result['kv_cache_dtype']}); load average "
             f"(1 min) before {result['load_average_before'][0]:.2f}, after {result['load_average_after'][0]:.2f}",
             "", "| policy | side | prefix hit rate | output tok/s | TTFT p50 (s) | TTFT p99 (s) |",
             "|---|---|---:|---:|---:|---:|"]
    for label in result["real"]:
        for side in ("real", "sim"):
            s = result[side][label]
            lines.append(f"| {label} | {side} | {s['prefix_hit_rate']:.1%} | {s['output_tokens_per_s']:,.1f} "
                         f"| {s['ttft_p50_s']:.3f} | {s['ttft_p99_s']:.3f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="h100,cpu", help="comma separated: h100, cpu (default: both)")
    parser.add_argument("--seeds", type=int, default=3, help="traces per profile, seeds 0..N-1 (default 3)")
    parser.add_argument("--bounds", default="", help="more lpm bounds to run, comma separated (e.g. 4,32)")
    parser.add_argument("--json", metavar="PATH", help="write every figure here")
    parser.add_argument("--real", action="store_true", help="also the real engine on this CPU at one load")
    parser.add_argument("--real-rate", type=float, default=REAL_RATE, help=f"its arrival rate (default {REAL_RATE})")
    parser.add_argument("--real-requests", type=int, default=REAL_REQUESTS,
                        help=f"its requests (default {REAL_REQUESTS})")
    parser.add_argument("--real-blocks", type=int, default=REAL_KV_BLOCKS,
                        help=f"its KV blocks of 16 tokens (default {REAL_KV_BLOCKS})")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                        help=f"before the real runs, wait up to S seconds for a load average under "
                             f"{QUIET_LOAD}, and skip them if it never falls (default 0: run at once)")
    parser.add_argument("--num-threads", type=int, default=1,
                        help="the real engine's torch threads (default 1: two stall on every OpenMP barrier "
                             "while another process holds a core; decode steps took 10x longer)")
    args = parser.parse_args()

    for bound in (int(b) for b in args.bounds.split(",") if b.strip()):
        POLICIES[f"lpm bound {bound}"] = ("lpm", {"lpm_max_bypass": bound})
    labels = list(POLICIES)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    document: dict[str, Any] = {"workload": WORKLOAD, "profiles": {n: vars_of(p) for n, p in PROFILES.items()},
                                "results": []}
    start = time.perf_counter()
    for name in (n.strip() for n in args.profile.split(",") if n.strip()):
        for seed in range(args.seeds):
            result = run_profile(name, seed, labels, log=log)
            document["results"].append(result)
            cost_model = PROFILES[name].cost_model.replace(f"{CPU_CALIBRATION.parent.parent.parent}/", "")
            print(markdown(result, cost_model) + f"\n\n(simulated in {result['wall_s']:.0f} s)\n", flush=True)
    if document["results"]:
        print(summary_markdown(document["results"], labels))
        print(f"\n(all simulations: {time.perf_counter() - start:.0f} s)\n", flush=True)
    if args.real and args.wait_quiet and not _wait_quiet(args.wait_quiet, log):
        print(f"the real runs were not taken: the load average stayed over {QUIET_LOAD} "
              f"for {args.wait_quiet:.0f} s")
    elif args.real:
        document["real"] = real = real_runs(args.real_rate, args.real_requests, args.real_blocks, 0,
                                            args.num_threads, ["fcfs", "lpm plain", PROPOSED], log=log)
        print(real_markdown(real))
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    return 0


def vars_of(profile: Profile) -> dict[str, Any]:
    return dataclasses.asdict(profile)


if __name__ == "__main__":
    sys.exit(main())
