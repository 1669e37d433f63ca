#!/usr/bin/env python3
"""Does async scheduling pay? The same work with and without it, side by side.

1. CPU, the default model through ``LLM.generate`` (greedy, fixed output
   lengths): tokens/s and time per step, at several batch sizes. The two
   engines live in one process and run in alternation, ``--repeats`` times
   each, the best kept (these machines are noisy); their outputs must be
   equal token for token.
2. The simulator on the H100 roofline (Llama-3-8B) with the host's time
   charged (``charge_host_time``: the engine loop's measured seconds per
   step, scheduling and absorbing, on this CPU): a synchronous step costs
   model + host, an overlapped one the slower of the two. Output tokens/s
   on the virtual clock, and the host's share of a synchronous step.

    python bench/async_scheduling.py                    # both parts (minutes)
    python bench/async_scheduling.py --skip-cpu --sim-requests 500
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "async_scheduling.json"

PROMPTS = [
    "Write a story about a lighthouse keeper.", "Explain how a database index works.",
    "Give me ten ideas for a birthday party.", "Describe the water cycle in detail.",
    "What makes a good teacher? Explain.", "Write a poem about the autumn rain.",
    "How do airplanes stay in the air?", "List the planets and describe each.",
]


def cpu_part(args) -> dict:
    import torch

    from cadence import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    engines = {mode: LLM(dtype=args.dtype, max_num_seqs=max(args.batches), kv_cache_memory="512MiB",
                         max_model_len=1024, async_scheduling=mode == "async")
               for mode in ("sync", "async")}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm in engines.values():
        llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)
    rows = {}
    for batch in args.batches:
        prompts = (PROMPTS * batch)[:batch]
        best: dict[str, dict] = {}
        outputs: dict[str, list] = {}
        for _ in range(args.repeats):
            for mode, llm in engines.items():
                core = llm.engine.core
                steps_before = core.num_steps
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - start
                num_steps = core.num_steps - steps_before
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                outputs[mode] = [o.outputs[0].token_ids for o in outs]
                result = {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds,
                          "steps": num_steps, "ms_per_step": 1e3 * seconds / num_steps}
                if mode not in best or result["tok_s"] > best[mode]["tok_s"]:
                    best[mode] = result
        same = outputs["sync"] == outputs["async"]
        rows[f"batch {batch}"] = {**best, "async_over_sync": best["async"]["tok_s"] / best["sync"]["tok_s"],
                                  "outputs_equal": same}
        print(f"  cpu batch {batch:3d}: sync {best['sync']['tok_s']:7.1f} tok/s "
              f"({best['sync']['ms_per_step']:.2f} ms/step), async {best['async']['tok_s']:7.1f} tok/s "
              f"({best['async']['ms_per_step']:.2f} ms/step): x{rows[f'batch {batch}']['async_over_sync']:.3f}"
              f"{'' if same else '  OUTPUTS DIFFER'}", file=sys.stderr)
    return rows


def sim_part(args) -> dict:
    from dataclasses import replace

    from cadence.config import CacheConfig, SchedulerConfig
    from cadence.sim.cost_model import make_cost_model
    from cadence.sim.simulator import Simulator
    from cadence.sim.workload import SyntheticWorkload

    cost_model = make_cost_model("roofline:h100", "llama-3-8b")
    specs = SyntheticWorkload(num_requests=args.sim_requests, rate=args.sim_rate,
                              prompt_len="uniform:64:1024", output_len="uniform:32:512", seed=7).generate()
    rows = {}
    for max_num_seqs in args.sim_max_num_seqs:
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, max_model_len=4096)
        best: dict[str, dict] = {}
        for _ in range(args.repeats):
            for mode in ("sync", "async"):
                simulator = Simulator(replace(config, async_scheduling=mode == "async"), CacheConfig(),
                                      cost_model, charge_host_time=True)
                result = simulator.run(specs, label=mode)
                summary = result.summary()
                row = {"output_tok_s": summary["throughput"]["output_tokens_per_s"],
                       "steps": result.num_steps, "clock_s": result.clock_s,
                       "ms_per_step": 1e3 * result.clock_s / result.num_steps,
                       "host_ms_per_step": 1e3 * simulator.clock.host_seconds / result.num_steps,
                       "ttft_p50_s": summary["ttft_s"]["p50"], "tpot_p50_s": summary["tpot_s"]["p50"]}
                if mode not in best or row["output_tok_s"] > best[mode]["output_tok_s"]:
                    best[mode] = row
        sync = best["sync"]
        rows[f"max_num_seqs {max_num_seqs}"] = {
            **best, "async_over_sync": best["async"]["output_tok_s"] / sync["output_tok_s"],
            "host_share_of_sync_step": sync["host_ms_per_step"] / sync["ms_per_step"]}
        print(f"  sim h100 max_num_seqs {max_num_seqs:4d}: sync {sync['output_tok_s']:8.0f} tok/s "
              f"({sync['ms_per_step']:.2f} ms/step, host {sync['host_ms_per_step']:.2f}), "
              f"async {best['async']['output_tok_s']:8.0f} tok/s ({best['async']['ms_per_step']:.2f} ms/step): "
              f"x{best['async']['output_tok_s'] / sync['output_tok_s']:.3f}", file=sys.stderr)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--sim-requests", type=int, default=2000)
    parser.add_argument("--sim-rate", type=float, default=1000.0, help="arrivals/s: past capacity, so throughput-bound")
    parser.add_argument("--sim-max-num-seqs", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256])
    parser.add_argument("--skip-cpu", action="store_true")
    parser.add_argument("--skip-sim", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = {}
    if not args.skip_cpu:
        results["cpu"] = cpu_part(args)
    if not args.skip_sim:
        results["sim_h100"] = sim_part(args)
    print(json.dumps({part: {k: round(v["async_over_sync"], 3) for k, v in rows.items()}
                      for part, rows in results.items()}, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": os.uname().nodename, "args": {
        k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))


if __name__ == "__main__":
    main()
