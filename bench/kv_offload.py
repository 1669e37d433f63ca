#!/usr/bin/env python3
"""Does the host-memory KV tier pay? The same work with and without it, side by side.

1. Shared prefixes that do not fit the primary cache: ``--prefixes`` long
   system prompts, each request one of them plus its own question, sent in
   round-robin so a prefix comes back only after the others pushed it out of
   the primary prefix cache (``--primary-tokens``). Plain engine against the
   engine with a tier (``--kv-offload-size``): prefix hit rate (primary and
   tier), TTFT (p50, mean), tokens computed. Outputs must be equal.
2. Preemption-heavy: ``--crowd`` requests with long outputs at once on a
   small pool (``--crowd-tokens``): recompute (no tier), then with a tier
   recompute, swap and auto. Wall time, tokens computed, tokens recomputed
   (computed beyond a run on a pool large enough never to preempt),
   preemptions and swaps. Outputs must equal the unpreempted run's.

3. ``--sim``: the same two workloads in the simulator on the H100 roofline
   (Llama-3-8B), the tier behind PCIe and behind NVLink-C2C (virtual clock:
   may run on a busy machine).

Parts 1 and 2 use the default model (SmolLM2-135M), greedy, prompts of
random token ids (no tokenizer in the loop). Each configuration runs
``--repeats`` times, the best wall time kept (these machines are noisy).

    python bench/kv_offload.py                          # parts 1 and 2 (minutes, a quiet machine)
    python bench/kv_offload.py --sim                    # part 3 only (seconds)
    python bench/kv_offload.py --requests 6 --crowd 4 --repeats 1 --max-tokens 8   # a quick check
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "kv_offload.json"


def make_engine(model, model_config, args, num_tokens: int, **options):
    from cadence.config import EngineOptions
    from cadence.engine.builder import assemble_engine

    options = EngineOptions.from_kwargs(
        device="cpu", dtype=args.dtype, block_size=args.block_size,
        num_gpu_blocks=num_tokens // args.block_size, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, **options)
    engine = assemble_engine(options, model, model_config, None, log=io.StringIO())
    engine.tokens_computed = 0
    execute = engine.core.runner.execute_model

    def counting_execute(scheduler_output):
        engine.tokens_computed += scheduler_output.total_num_scheduled_tokens
        return execute(scheduler_output)

    engine.core.runner.execute_model = counting_execute
    return engine


def run_requests(engine, prompts: dict[str, list[int]], max_tokens: int, concurrency: int) -> dict:
    """Run the prompts, ``concurrency`` at a time in order; tokens, TTFTs, stats."""
    from cadence.core.request import Request
    from cadence.sampling_params import SamplingParams

    core = engine.core
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    pending = list(prompts.items())
    tokens = {req_id: [] for req_id in prompts}
    sent_at, ttft, finished = {}, {}, set()
    hits = {"primary": 0, "tier": 0, "queries": 0}
    start = time.perf_counter()
    while pending or core.has_work():
        while pending and len(sent_at) - len(finished) < concurrency:
            req_id, prompt = pending.pop(0)
            sent_at[req_id] = time.perf_counter()
            core.add_request(Request(req_id, prompt, params))
        for outputs in core.step().values():
            _count_hits(outputs.scheduler_stats, hits)
            for output in outputs.outputs:
                if output.new_token_ids and output.request_id not in ttft:
                    ttft[output.request_id] = time.perf_counter() - sent_at[output.request_id]
                tokens[output.request_id].extend(output.new_token_ids)
                if output.finish_reason is not None:
                    finished.add(output.request_id)
    return {"seconds": time.perf_counter() - start, "tokens": tokens, "ttft": ttft, "hits": hits}


def _count_hits(stats, hits: dict) -> None:
    if stats is None:
        return
    prefix = stats.prefix_cache_stats
    hits["primary"] += prefix.hits
    hits["queries"] += prefix.queries
    if stats.connector_prefix_cache_stats is not None:
        hits["tier"] += stats.connector_prefix_cache_stats.hits


def best_of(args, make, prompts, max_tokens, concurrency) -> tuple[dict, object]:
    """The fastest of ``--repeats`` runs, each on a fresh engine."""
    best, best_engine = None, None
    for _ in range(args.repeats):
        engine = make()
        result = run_requests(engine, prompts, max_tokens, concurrency)
        if best is None or result["seconds"] < best["seconds"]:
            best, best_engine = result, engine
    return best, best_engine


def shared_prefix_part(model, model_config, args) -> dict:
    rng = random.Random(0)
    vocab = model_config.vocab_size
    prefixes = [[rng.randrange(vocab) for _ in range(args.prefix_len)] for _ in range(args.prefixes)]
    prompts = {f"q{i}": prefixes[i % args.prefixes] + [rng.randrange(vocab) for _ in range(args.question_len)]
               for i in range(args.requests)}
    rows = {}
    for label, options in (("plain", {}), ("tier", {"kv_offload_size": args.kv_offload_size})):
        result, engine = best_of(args, lambda: make_engine(model, model_config, args, args.primary_tokens, **options),
                                 prompts, args.max_tokens, args.concurrency)
        ttfts = sorted(result["ttft"].values())
        hits = result["hits"]
        rows[label] = {
            "seconds": result["seconds"], "ttft_p50_s": statistics.median(ttfts),
            "ttft_mean_s": statistics.fmean(ttfts), "tokens_computed": engine.tokens_computed,
            "primary_hit_rate": hits["primary"] / max(1, hits["queries"]),
            "tier_hit_rate": hits["tier"] / max(1, hits["queries"]),
            "tokens": result["tokens"]}
    plain, tier = rows["plain"], rows["tier"]
    rows["outputs_equal"] = plain.pop("tokens") == tier.pop("tokens")
    rows["ttft_p50_plain_over_tier"] = plain["ttft_p50_s"] / tier["ttft_p50_s"]
    for label in ("plain", "tier"):
        row = rows[label]
        print(f"  shared prefix, {label:5s}: hit rate primary {row['primary_hit_rate']:.2f} "
              f"tier {row['tier_hit_rate']:.2f}, TTFT p50 {1e3 * row['ttft_p50_s']:.1f} ms "
              f"mean {1e3 * row['ttft_mean_s']:.1f} ms, {row['tokens_computed']} tokens computed, "
              f"{row['seconds']:.2f} s", file=sys.stderr)
    print(f"  shared prefix: TTFT p50 plain/tier x{rows['ttft_p50_plain_over_tier']:.2f}"
          f"{'' if rows['outputs_equal'] else '  OUTPUTS DIFFER'}", file=sys.stderr)
    return rows


def preemption_part(model, model_config, args) -> dict:
    rng = random.Random(1)
    vocab = model_config.vocab_size
    prompts = {f"c{i}": [rng.randrange(vocab) for _ in range(rng.randint(*args.crowd_prompt))]
               for i in range(args.crowd)}
    reference, ref_engine = best_of(args, lambda: make_engine(model, model_config, args, args.max_model_len * args.crowd),
                                    prompts, args.crowd_max_tokens, args.crowd)
    rows = {"reference": {"seconds": reference["seconds"], "tokens_computed": ref_engine.tokens_computed}}
    configs = (("recompute, no tier", {}),
               *((f"{mode}, tier", {"kv_offload_size": args.kv_offload_size, "preemption_mode": mode})
                 for mode in ("recompute", "swap", "auto")))
    for label, options in configs:
        result, engine = best_of(args, lambda: make_engine(model, model_config, args, args.crowd_tokens, **options),
                                 prompts, args.crowd_max_tokens, args.crowd)
        scheduler = engine.core.scheduler
        rows[label] = {
            "seconds": result["seconds"], "tokens_computed": engine.tokens_computed,
            "tokens_recomputed": engine.tokens_computed - ref_engine.tokens_computed,
            "preemptions": scheduler.num_preemptions_total,
            "swapped": scheduler.num_swapped_preemptions_total,
            "outputs_equal": result["tokens"] == reference["tokens"]}
        row = rows[label]
        print(f"  preemption, {label:18s}: {row['seconds']:.2f} s, {row['tokens_recomputed']} tokens "
              f"recomputed, {row['preemptions']} preemptions ({row['swapped']} swapped)"
              f"{'' if row['outputs_equal'] else '  OUTPUTS DIFFER'}", file=sys.stderr)
    base = rows["recompute, no tier"]["seconds"]
    rows["wall_time_over_no_tier"] = {label: rows[label]["seconds"] / base for label, _ in configs}
    return rows


def sim_part(args) -> dict:
    from cadence.config import CacheConfig, SchedulerConfig
    from cadence.sim.cost_model import make_cost_model
    from cadence.sim.kv_tier import SimKVTier
    from cadence.sim.simulator import Simulator
    from cadence.sim.workload import SyntheticWorkload

    cost_model = make_cost_model("roofline:h100", "llama-3-8b")
    config = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096)

    def simulate(specs, num_blocks, tier, caching=True):
        simulator = Simulator(config, CacheConfig(num_gpu_blocks=num_blocks, enable_prefix_caching=caching),
                              cost_model, kv_tier=tier)
        result = simulator.run(specs)
        copies = simulator.runner.transfers
        return simulator, result, {
            "clock_s": result.clock_s, "tokens_computed": simulator.runner.num_tokens_computed,
            "preemptions": result.num_preemptions,
            "swapped": simulator.scheduler.num_swapped_preemptions_total,
            "copy_s": copies.copy_seconds if copies is not None else 0.0}

    tiers = {"plain": None, **{f"tier {link}": SimKVTier(args.sim_tier_gib, link) for link in ("pcie", "nvlink")}}
    prefix_specs = SyntheticWorkload(
        num_requests=args.sim_requests, rate=args.sim_rate, prompt_len="fixed:2048", output_len="uniform:16:128",
        prefix_groups=args.sim_prefix_groups, prefix_fraction=1.0, prefix_tokens=1536, seed=3).generate()
    prefix_rows = {}
    for label, tier in tiers.items():
        _, result, row = simulate(prefix_specs, args.sim_primary_blocks, tier)
        summary = result.summary()
        row.update(prefix_hit_rate=summary["prefix_hit_rate"], ttft_p50_s=summary["ttft_s"]["p50"],
                   ttft_p90_s=summary["ttft_s"]["p90"])
        prefix_rows[label] = row
        print(f"  sim shared prefix, {label:11s}: hit rate {row['prefix_hit_rate']:.2f}, TTFT p50 "
              f"{1e3 * row['ttft_p50_s']:.1f} ms p90 {1e3 * row['ttft_p90_s']:.1f} ms, "
              f"{row['tokens_computed']} tokens computed, copies {row['copy_s']:.2f} s", file=sys.stderr)
    crowd_specs = SyntheticWorkload(num_requests=args.sim_requests, rate=0, prompt_len="uniform:256:2048",
                                    output_len="uniform:256:1024", seed=5).generate()
    crowd_rows = {}
    _, _, reference = simulate(crowd_specs, 10 * args.sim_primary_blocks * 16, None, caching=False)
    configs = {"recompute, no tier": None, **{
        f"{mode}, {link}": SimKVTier(args.sim_tier_gib, link, mode)
        for mode in ("recompute", "swap", "auto") for link in ("pcie", "nvlink")}}
    for label, tier in configs.items():
        _, _, row = simulate(crowd_specs, args.sim_primary_blocks, tier, caching=False)
        row["tokens_recomputed"] = row["tokens_computed"] - reference["tokens_computed"]
        crowd_rows[label] = row
        print(f"  sim preemption, {label:18s}: {row['clock_s']:.2f} s, {row['tokens_recomputed']} tokens "
              f"recomputed, {row['preemptions']} preemptions ({row['swapped']} swapped), "
              f"copies {row['copy_s']:.2f} s", file=sys.stderr)
    return {"shared_prefix": prefix_rows, "preemption": crowd_rows, "reference": reference}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    pair = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kv-offload-size", type=float, default=1.0, help="GiB of the tier")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=384)
    parser.add_argument("--question-len", type=int, default=24)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--primary-tokens", type=int, default=1024,
                        help="the primary KV cache: fewer tokens than the prefixes together")
    parser.add_argument("--crowd", type=int, default=16)
    parser.add_argument("--crowd-prompt", type=pair, default=(64, 256), help="min,max prompt tokens")
    parser.add_argument("--crowd-max-tokens", type=int, default=128)
    parser.add_argument("--crowd-tokens", type=int, default=1536, help="the pool of the preemption part")
    parser.add_argument("--sim", action="store_true", help="only the simulator part")
    parser.add_argument("--sim-requests", type=int, default=400)
    parser.add_argument("--sim-rate", type=float, default=20.0)
    parser.add_argument("--sim-prefix-groups", type=int, default=48)
    parser.add_argument("--sim-primary-blocks", type=int, default=4096, help="16-token blocks")
    parser.add_argument("--sim-tier-gib", type=float, default=64.0)
    parser.add_argument("--skip-prefix", action="store_true")
    parser.add_argument("--skip-preemption", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.sim:
        print(f"python bench/kv_offload.py {' '.join(argv if argv is not None else sys.argv[1:])}\n"
              f"  the simulator: H100 roofline, Llama-3-8B (virtual clock)", file=sys.stderr)
        results = {"sim_h100": sim_part(args)}
        out = args.out.with_name("kv_offload_sim.json") if args.out == RESULTS else args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                  indent=1))
        print(f"  written to {out}", file=sys.stderr)
        return
    import torch

    from cadence.models.loader import load_model

    torch.set_num_threads(args.threads)
    print(f"python bench/kv_offload.py {' '.join(argv if argv is not None else sys.argv[1:])}\n"
          f"  on {platform.node()} ({platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cpus, torch {torch.__version__}, {args.threads} threads)", file=sys.stderr)
    model, _, model_config = load_model(None, getattr(torch, args.dtype))
    results = {}
    if not args.skip_prefix:
        results["shared_prefix"] = shared_prefix_part(model, model_config, args)
    if not args.skip_preemption:
        results["preemption"] = preemption_part(model, model_config, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": platform.node(), "args": {
        k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))
    print(f"  written to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
