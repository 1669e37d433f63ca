#!/usr/bin/env python3
"""Every default against the best explicit configuration (issue 31 item 6).

For one GGUF (default: the embedded SmolLM2), each configuration in its own
process, one after another: first ``defaults`` (``LLM(model=...)`` and no
other option), then every combination of ``--dtypes`` x ``--kv-cache-dtypes``
x ``--threads``. Each process measures, greedy with EOS ignored:

    single stream   --single-prompts prompts of cpu-throughput-v1, one at a
                    time, 128 new tokens: decode tokens/s (the 127 tokens
                    after the first step, which is the prefill)
    batch 64        cpu-throughput-v1's 64 prompts at once, 128 new tokens:
                    output tokens/s (prefill included)
    prefill         a 2,000-token prompt (bench/data/perplexity.txt's text),
                    1 new token: prompt tokens/s
    peak RSS        the process's VmHWM at the end

The report gives each figure of the defaults against the best explicit
configuration's (the ratio, target >= 0.95) and says which is best. With
``--llamacpp-python`` (a Python with llama-cpp-python) llama.cpp runs the
same three measures on the same file and threads, for the record.
``--one-call`` adds the one-call decoder against the layers one by one
(defaults otherwise), single stream. ``--pairs N`` runs the defaults and
llama.cpp N times, alternately, and reports each pair's ratios and their
median: on a machine whose speed drifts from minute to minute, a ratio of
two processes run minutes apart means little.

    python bench/defaults.py --quick                      # a smoke run
    python bench/defaults.py --llamacpp-python /work/llamacpp-peer/bin/python --one-call
    python bench/defaults.py --model gemma-3-270m-q4_k_m.gguf --threads 2

Each run waits for a quiet moment (see bench/throughput.py: two threads on
two cores stall at every OpenMP barrier when anything else runs).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

from throughput import WORKLOAD_FILE, make_header, run_measured_child, uptime

HERE = Path(__file__).resolve().parent
PEER = HERE.parent.parent / "shared" / "peers" / "llamacpp"
MAX_TOKENS = 128
PREFILL_TOKENS = 2000
RESULT_MARK = "RESULT "
QUICK = {"max_tokens": 8, "num_prompts": 4, "prefill_tokens": 200, "single_prompts": 1}
FIGURES = ("single-stream decode tok/s", "batch-64 tok/s", "prefill tok/s")


def prefill_ids(tokenize, count: int, offset: int) -> list[int]:
    """``count`` token ids of the fixed text, starting ``offset`` tokens in (a
    different offset per prompt, so no prefix is cached between them)."""
    ids = tokenize((HERE / "data" / "perplexity.txt").read_text())
    return ids[offset:offset + count]


def workload_prompts(model: str, num_prompts: int):
    """cpu-throughput-v1's user messages through ``model``'s chat template (token ids; the
    raw message where the file has no template, as Gemma 3 270M's), and the model's tokenizer."""
    from cadence.models.gguf_loader import read_gguf
    from cadence.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf_metadata(read_gguf(model)[1])
    messages = json.loads(WORKLOAD_FILE.read_text())["user_messages"][:num_prompts]
    if tokenizer.chat_template is None:
        return [tokenizer.encode(m) for m in messages], tokenizer
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True)
             for m in messages]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts], tokenizer


def peak_rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
    return float("nan")


# ==================================================================== children


def run_cadence(job: dict) -> dict:
    from cadence.engine.llm import LLM
    from cadence.sampling_params import SamplingParams

    llm = LLM(model=job["model"], **job["options"])
    if job.get("layer_by_layer"):
        llm.engine.core.runner.fused_decoder = None
    core = llm.engine.core
    prompts, max_tokens = job["prompt_ids"], job["max_tokens"]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[-1]}], params, use_tqdm=False)  # warm-up

    step_ends: list[float] = []
    step = core.step
    core.step = lambda: (step(), step_ends.append(time.perf_counter()))[0]
    decode_s = 0.0
    for ids in prompts[:job["single_prompts"]]:
        step_ends.clear()
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        decode_s += step_ends[max_tokens - 1] - step_ends[0]  # steps 2..max_tokens: one token each
    core.step = step
    single = job["single_prompts"] * (max_tokens - 1) / decode_s

    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    batch = len(prompts) * max_tokens / (time.perf_counter() - start)

    one = SamplingParams(max_tokens=1, temperature=0.0)
    tokenize = lambda text: llm.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    llm.generate([{"prompt_token_ids": prefill_ids(tokenize, job["prefill_tokens"], 0)}], one, use_tqdm=False)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prefill_ids(tokenize, job["prefill_tokens"], job["prefill_tokens"])}],
                 one, use_tqdm=False)
    prefill = job["prefill_tokens"] / (time.perf_counter() - start)
    runner = core.runner
    return {FIGURES[0]: single, FIGURES[1]: batch, FIGURES[2]: prefill, "peak RSS MiB": peak_rss_mib(),
            "dtype": str(runner.dtype).removeprefix("torch."),
            "kv cache": str(runner.kv_cache.data.dtype).removeprefix("torch."),
            "threads": __import__("torch").get_num_threads(),
            "one-call decoder": runner.fused_decoder is not None}


def run_llamacpp(job: dict) -> dict:
    sys.path.insert(0, str(PEER))
    import llamacpp_bench as peer  # noqa: E402  (the shared peer harness's Engine)

    threads, max_tokens, prompts = job["threads"], job["max_tokens"], job["prompt_ids"]
    single_engine = peer.Engine(job["model"], 1, 4096, 2048, threads)
    single_engine.run([prompts[-1]], max_tokens)  # warm-up
    decode_s = 0.0
    for ids in prompts[:job["single_prompts"]]:
        _, _, seconds = single_engine.run([ids], max_tokens)
        decode_s += seconds
    single = job["single_prompts"] * (max_tokens - 1) / decode_s
    long_prompt = job["prefill_prompt_ids"]
    _, prefill_s, _ = single_engine.run([long_prompt], 1)
    single_engine.close()
    batch_engine = peer.Engine(job["model"], len(prompts), 256 * len(prompts), 2048, threads)
    start = time.perf_counter()
    batch_engine.run(prompts, max_tokens)
    batch = len(prompts) * max_tokens / (time.perf_counter() - start)
    batch_engine.close()
    return {FIGURES[0]: single, FIGURES[1]: batch, FIGURES[2]: len(long_prompt) / prefill_s,
            "peak RSS MiB": peak_rss_mib(), "threads": threads}


def child_main(kind: str) -> None:
    job = json.loads(sys.stdin.read())
    result = run_cadence(job) if kind == "cadence" else run_llamacpp(job)
    print(RESULT_MARK + json.dumps(result), flush=True)


# ==================================================================== parent


def configurations(args) -> list[tuple[str, dict]]:
    """(name, LLM options): the defaults first, then the explicit grid."""
    grid = [("defaults", {})]
    for dtype, kv, threads in itertools.product(args.dtypes.split(","), args.kv_cache_dtypes.split(","),
                                                (int(t) for t in args.threads.split(","))):
        grid.append((f"{dtype}, kv {kv}, {threads} threads",
                     {"dtype": dtype, "kv_cache_dtype": kv, "num_threads": threads}))
    return grid


def run_child(kind: str, job: dict, args) -> dict:
    """One measured process, repeated (up to --max-attempts) while others kept cores busy."""
    python = args.llamacpp_python if kind == "llamacpp" else sys.executable
    return run_measured_child([python, __file__, "--child", kind], job, cwd=HERE.parent, timeout_s=1800,
                              max_attempts=args.max_attempts, max_others=args.max_others,
                              wait_quiet_s=args.wait_quiet)


def pair_ratios(pairs: list[tuple[dict, dict]]) -> str:
    """Each (defaults, llama.cpp) pair's ratios, one line a figure, and their median."""
    lines = ["", f"defaults / llama.cpp, {len(pairs)} pairs run alternately (each pair's ratio; median):"]
    for figure in FIGURES:
        ratios = [ours[figure] / theirs[figure] for ours, theirs in pairs]
        lines.append(f"- {figure}: " + ", ".join(f"{r:.2f}x" for r in ratios)
                     + f"; median {statistics.median(ratios):.2f}x")
    return "\n".join(lines)


def report(results: dict[str, dict], model: str) -> str:
    explicit = {name: r for name, r in results.items() if name not in ("defaults", "llama.cpp")
                and not name.startswith("defaults,")}
    lines = [f"model: {model}", "",
             "| configuration | single-stream decode tok/s | batch-64 tok/s | prefill tok/s | peak RSS MiB | "
             "resolved | others busy |", "|---|---:|---:|---:|---:|---|---:|"]
    for name, r in results.items():
        resolved = (f"{r['dtype']}, kv {r['kv cache']}, {r['threads']} threads"
                    + ("" if r["one-call decoder"] else ", layer by layer")) if "dtype" in r else f"{r['threads']} threads"
        lines.append(f"| {name} | {r[FIGURES[0]]:.1f} | {r[FIGURES[1]]:.1f} | {r[FIGURES[2]]:.1f} | "
                     f"{r['peak RSS MiB']:.0f} | {resolved} | {r['others busy cores']} |")
    if explicit and "defaults" in results:
        lines += ["", "| figure | defaults | best explicit | which | defaults / best | target >= 0.95 |",
                  "|---|---:|---:|---|---:|---|"]
        for figure in FIGURES:
            best_name = max(explicit, key=lambda name: explicit[name][figure])
            best, default = explicit[best_name][figure], results["defaults"][figure]
            ratio = default / best
            lines.append(f"| {figure} | {default:.1f} | {best:.1f} | {best_name} | {ratio:.3f} | "
                         f"{'met' if ratio >= 0.95 else 'NOT met'} |")
    if "defaults, layer by layer" in results:
        one_call = results["defaults"][FIGURES[0]] / results["defaults, layer by layer"][FIGURES[0]]
        lines.append(f"\none-call decoder / layer by layer, single stream: {one_call:.2f}x")
    if "llama.cpp" in results and "defaults" in results:
        lines.append("\ndefaults / llama.cpp: " + ", ".join(
            f"{figure} {results['defaults'][figure] / results['llama.cpp'][figure]:.2f}x" for figure in FIGURES))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a GGUF (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--kv-cache-dtypes", default="auto,float16")
    parser.add_argument("--threads", default="1,2", help="comma list of --num-threads values")
    parser.add_argument("--single-prompts", type=int, default=4)
    parser.add_argument("--one-call", action="store_true", help="also the defaults with the layers one by one")
    parser.add_argument("--llamacpp-python", metavar="PYTHON", help="a Python with llama-cpp-python")
    parser.add_argument("--llamacpp-threads", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=1, metavar="N",
                        help="run the defaults and llama.cpp N times, alternately (with --llamacpp-python)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few prompts and tokens")
    parser.add_argument("--max-others", type=float, default=0.25, metavar="CORES")
    parser.add_argument("--max-attempts", type=int, default=2)
    parser.add_argument("--wait-quiet", type=float, default=60.0, metavar="SECONDS")
    parser.add_argument("--json", metavar="PATH", help="also write every figure to this JSON file")
    parser.add_argument("--child", choices=("cadence", "llamacpp"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(args.child)

    sys.path.insert(0, str(HERE.parent))
    from cadence.models.default_model import default_model_path

    model = args.model or str(default_model_path())
    quick = QUICK if args.quick else {}
    prompt_ids, tokenizer = workload_prompts(model, quick.get("num_prompts", 64))
    job = {"model": model, "prompt_ids": prompt_ids, "max_tokens": quick.get("max_tokens", MAX_TOKENS),
           "single_prompts": quick.get("single_prompts", args.single_prompts),
           "prefill_tokens": quick.get("prefill_tokens", PREFILL_TOKENS)}
    print("command: " + " ".join(["python", "bench/defaults.py", *sys.argv[1:]]), flush=True)
    print(json.dumps(make_header(len(prompt_ids), job["max_tokens"])), flush=True)
    results: dict[str, dict] = {}
    runs = [(name, job | {"options": options}) for name, options in configurations(args)]
    if args.one_call:
        runs.insert(1, ("defaults, layer by layer", job | {"options": {}, "layer_by_layer": True}))
    for name, child_job in runs:
        print(f"running {name} ({uptime()}) ...", flush=True)
        results[name] = run_child("cadence", child_job, args)
        print(f"  {json.dumps(results[name])}", flush=True)
    if args.llamacpp_python:
        tokenize = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        peer_job = job | {"threads": args.llamacpp_threads,
                          "prefill_prompt_ids": prefill_ids(tokenize, job["prefill_tokens"], job["prefill_tokens"])}
        pairs = []
        for k in range(args.pairs):
            if k:
                print(f"running defaults again, pair {k + 1} ({uptime()}) ...", flush=True)
                ours = run_child("cadence", job | {"options": {}}, args)
                print(f"  {json.dumps(ours)}", flush=True)
            print(f"running llama.cpp ({uptime()}) ...", flush=True)
            theirs = run_child("llamacpp", peer_job, args)
            print(f"  {json.dumps(theirs)}", flush=True)
            pairs.append((ours if k else results["defaults"], theirs))
        results["llama.cpp"] = pairs[0][1]
    text = report(results, model)
    if args.llamacpp_python and args.pairs > 1:
        text += "\n" + pair_ratios(pairs)
        results["pairs"] = [{"defaults": ours, "llama.cpp": theirs} for ours, theirs in pairs]
    print("\n" + text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
