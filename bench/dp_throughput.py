#!/usr/bin/env python3
"""Data parallelism on this machine: 1 versus 2 local replicas, one core each,
on workload ``cpu-throughput-v1``.

The workload is bench/throughput.py's (../shared/workloads/README.md): the
64 chat prompts of ``cpu-throughput-v1.json`` through the default model's
chat template, greedy, exactly 128 new tokens each (EOS ignored), all
submitted at once; figure: output tokens/s from submit to last token. What
differs is the shape of the engine:

    1x1   one engine-core process, 1 thread, pinned to core 0
    2x1   two engine-core replicas (--data-parallel-size 2, local processes),
          1 thread each, pinned to cores 0 and 1; the front end routes
          (--dp-routing, default cache_aware: the prompts share only the chat
          template's first tokens, so it balances by load)
    1x2   the workload's usual shape, for reference: one engine, 2 threads

Each shape is the server's own front end (``make_async_llm``, as ``cadence
serve`` builds it), driven in this process without HTTP. Every shape gets the
same prompt ids, a warm-up on unrelated ids, then ``--runs`` timed runs, each
after a quiet moment; "other procs" is the cores other processes used during
the run (the machine may be shared), and runs above ``--max-others`` are
marked. The table gives each shape's best undisturbed run and its ratio to 1x1.

    python bench/dp_throughput.py                    # the figure (a few minutes)
    python bench/dp_throughput.py --quick            # 8 prompts x 32 tokens: a check
    python bench/dp_throughput.py --shapes 1x1,2x1 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import (  # noqa: E402  (bench/throughput.py: the workload's own helpers)
    KV_BLOCK_SIZE, MAX_BATCHED_TOKENS, MAX_TOKENS, QUICK_PROMPTS, QUICK_TOKENS, WARMUP_PROMPTS,
    WARMUP_TOKENS, WORKLOAD, _busy_cpu_seconds, uptime, wait_for_quiet, workload_prompt_ids,
)

SHAPES = ("1x1", "2x1", "1x2")


@dataclass(frozen=True)
class Shape:
    name: str
    num_replicas: int
    num_threads: int

    @classmethod
    def parse(cls, name: str) -> "Shape":
        replicas, threads = (int(x) for x in name.split("x"))
        return cls(name, replicas, threads)

    @property
    def pinned(self) -> bool:
        """One core per replica (one thread each) when the machine has the cores."""
        return self.num_threads == 1 and self.num_replicas <= (os.cpu_count() or 1)


def _tree_cpu_seconds(pids: list[int]) -> float:
    """CPU seconds of this process and of ``pids`` (the engine processes)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = sum(os.times()[:2])
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
        except (OSError, IndexError):
            pass
    return total


def pin_process(pid: int, core: int) -> None:
    """Every thread of ``pid`` on ``core`` (affinity is per thread; threads started
    later inherit it)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), {core})


def _engine_pids(llm) -> list[int]:
    replicas = getattr(llm, "replicas", None) or [llm]
    return [replica.process.pid for replica in replicas]


async def generate(llm, prompt_ids: list[list[int]], max_tokens: int, tag: str) -> list[int]:
    from cadence.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    streams = [llm.add_request(f"{tag}-{i}", ids, params) for i, ids in enumerate(prompt_ids)]

    async def count(stream) -> int:
        last = None
        async for output in stream:
            last = output
        return len(last.outputs[0].token_ids)

    return list(await asyncio.gather(*(count(stream) for stream in streams)))


async def measure(shape: Shape, model_path: str, prompt_ids: list[list[int]], max_tokens: int,
                  args: argparse.Namespace) -> dict:
    from cadence.config import EngineOptions
    from cadence.engine.dp_client import make_async_llm

    per_seq = lambda n: -(-(n + max_tokens) // KV_BLOCK_SIZE)  # noqa: E731
    options = EngineOptions.from_kwargs(
        model=model_path, dtype=args.dtype, num_threads=shape.num_threads,
        data_parallel_size=shape.num_replicas, dp_routing=args.dp_routing,
        max_num_seqs=len(prompt_ids), max_num_batched_tokens=MAX_BATCHED_TOKENS,
        num_gpu_blocks=sum(per_seq(len(p)) for p in prompt_ids + WARMUP_PROMPTS))
    llm = make_async_llm(options)
    start = time.perf_counter()
    await llm.start(options, "SmolLM2-135M-Instruct")
    load_s = time.perf_counter() - start
    pids = _engine_pids(llm)
    if shape.pinned:
        for core, pid in enumerate(pids):
            pin_process(pid, core)
    runs = []
    try:
        await generate(llm, WARMUP_PROMPTS, WARMUP_TOKENS, "warmup")
        for run in range(args.runs):
            wait_for_quiet(args.quiet_wait)
            busy0, own0, t0 = _busy_cpu_seconds(), _tree_cpu_seconds(pids), time.perf_counter()
            counts = await generate(llm, prompt_ids, max_tokens, f"run{run}")
            wall = time.perf_counter() - t0
            own = _tree_cpu_seconds(pids) - own0
            others = max(0.0, _busy_cpu_seconds() - busy0 - own) / wall
            assert counts == [max_tokens] * len(prompt_ids), f"{shape.name}: token counts {counts}"
            runs.append({"tok_s": sum(counts) / wall, "wall_s": wall, "cores_used": own / wall,
                         "others_cores": others, "loadavg_1m": os.getloadavg()[0]})
            print(f"  {shape.name} run {run + 1}: {runs[-1]['tok_s']:.1f} tok/s, "
                  f"other procs {others:.2f} cores", flush=True)
    finally:
        await llm.shutdown()
    return {"shape": shape.name, "load_s": load_s, "pinned": shape.pinned, "runs": runs}


def best_run(result: dict, max_others: float) -> tuple[dict, bool]:
    """The fastest run among the undisturbed ones (else among all: marked)."""
    quiet = [r for r in result["runs"] if r["others_cores"] <= max_others]
    pool = quiet or result["runs"]
    return max(pool, key=lambda r: r["tok_s"]), bool(quiet)


def report(results: list[dict], max_others: float) -> str:
    base = next((r for r in results if r["shape"] == "1x1"), results[0])
    base_tok_s = best_run(base, max_others)[0]["tok_s"]
    lines = ["shape  tok/s    vs 1x1  cores used  other procs  pinned",
             "-----  -------  ------  ----------  -----------  ------"]
    for result in results:
        run, quiet = best_run(result, max_others)
        mark = "" if quiet else "  (disturbed: every run over --max-others)"
        lines.append(f"{result['shape']:<5}  {run['tok_s']:7.1f}  {run['tok_s'] / base_tok_s:5.2f}x  "
                     f"{run['cores_used']:10.2f}  {run['others_cores']:11.2f}  "
                     f"{'yes' if result['pinned'] else 'no':>6}{mark}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help="replicas x threads each, comma separated (default: 1x1,2x1,1x2)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--dp-routing", default="cache_aware",
                        choices=("round_robin", "least_loaded", "cache_aware"))
    parser.add_argument("--runs", type=int, default=3, help="timed runs per shape (default: 3)")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_PROMPTS} prompts x {QUICK_TOKENS} tokens, one run: a check")
    parser.add_argument("--max-others", type=float, default=0.25,
                        help="a run whose other processes used more cores is marked (default 0.25)")
    parser.add_argument("--quiet-wait", type=float, default=60.0,
                        help="seconds to wait for a quiet machine before each run (default: 60)")
    parser.add_argument("--json", metavar="PATH", help="write every run here")
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.quiet_wait = 1, 0.0
    return args


def main(argv: list[str] | None = None) -> int:
    from cadence.models.loader import default_model_path

    args = parse_args(argv)
    num_prompts, max_tokens = (QUICK_PROMPTS, QUICK_TOKENS) if args.quick else (64, MAX_TOKENS)
    model_path = str(default_model_path())
    prompt_ids = workload_prompt_ids(model_path, num_prompts)
    print(f"$ python bench/dp_throughput.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"{WORKLOAD}: {num_prompts} prompts x {max_tokens} tokens, {args.dtype}, greedy; "
          f"{os.cpu_count()} CPUs; {uptime()}", flush=True)
    results = [asyncio.run(measure(Shape.parse(name), model_path, prompt_ids, max_tokens, args))
               for name in args.shapes.split(",")]
    print(report(results, args.max_others))
    print(f"end: {uptime()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"workload": WORKLOAD, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
