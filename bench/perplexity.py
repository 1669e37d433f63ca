#!/usr/bin/env python3
"""Perplexity of a GGUF on a fixed text: cadence beside llama.cpp, same token ids.

The text (``bench/data/perplexity.txt`` by default: the GNU FDL 1.3, a fixed
text every machine has the same bytes of) is tokenized once with the model's
own tokenizer as cadence loads it. It is cut into chunks of ``--ctx`` tokens,
each starting with the model's BOS token (as llama.cpp's ``llama-perplexity``
does); within a chunk only the second half of the positions is scored, so
every scored token sees at least ``ctx/2`` tokens of context. Both engines get
exactly the same ids: perplexity is ``exp(mean negative log-likelihood)`` over
the scored tokens.

cadence runs through its engine (``LLM``, ``prompt_logprobs``), so the options
that change what a step reads count: ``--dtype``, ``--kv-cache-dtype``,
``--quantization``. llama.cpp runs in another interpreter that has
``llama-cpp-python`` (``--llamacpp-python``; see ../shared/peers/llamacpp).

    python bench/perplexity.py                                   # the default model
    python bench/perplexity.py --model /tmp/gemma-3-270m-q4_k_m.gguf \\
        --llamacpp-python ../llamacpp-peer/bin/python             # beside llama.cpp
    python bench/perplexity.py --kv-cache-dtype float16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_TEXT = Path(__file__).parent / "data" / "perplexity.txt"


def chunks_of(ids: list[int], bos: int | None, ctx: int, max_chunks: int | None) -> list[list[int]]:
    """``ctx``-token chunks of ``ids``, each led by ``bos`` (when the model has one)."""
    body = ctx - (bos is not None)
    chunks = []
    for start in range(0, len(ids) - body + 1, body):
        chunk = ids[start:start + body]
        chunks.append(([bos] if bos is not None else []) + chunk)
        if max_chunks is not None and len(chunks) == max_chunks:
            break
    if not chunks:
        raise ValueError(f"--ctx: the text has {len(ids)} tokens, fewer than one chunk of {ctx}")
    return chunks


def scored_positions(ctx: int) -> range:
    """The positions whose token is scored: the second half of a chunk."""
    return range(ctx // 2, ctx)


def perplexity(nlls: list[float]) -> dict:
    mean = sum(nlls) / len(nlls)
    # The standard error of the mean NLL, carried to the perplexity (as llama.cpp reports it).
    var = sum((x - mean) ** 2 for x in nlls) / max(1, len(nlls) - 1)
    stderr = math.sqrt(var / len(nlls))
    return {"ppl": math.exp(mean), "ppl_stderr": math.exp(mean) * stderr, "mean_nll": mean,
            "num_scored": len(nlls)}


# ----------------------------------------------------------------- cadence


def tokenize(model: str | None, text: str) -> tuple[list[int], int | None]:
    from cadence.engine.async_llm import load_tokenizer

    tokenizer = load_tokenizer(model)
    return tokenizer.encode(text, add_special_tokens=False), tokenizer.bos_token_id


def cadence_nlls(args: argparse.Namespace, chunks: list[list[int]]) -> tuple[list[float], float]:
    from cadence.engine.llm import LLM
    from cadence.sampling_params import SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
              quantization=args.quantization, num_threads=args.threads, max_model_len=args.ctx + 1,
              max_num_seqs=args.batch, enable_prefix_caching=False, kv_cache_memory=args.kv_cache_memory)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": c} for c in chunks], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    nlls = []
    for chunk, output in zip(chunks, outputs):
        rows = output.prompt_logprobs
        for position in scored_positions(len(chunk)):
            nlls.append(-rows[position][chunk[position]].logprob)
    return nlls, seconds


# ----------------------------------------------------------------- llama.cpp


# llama.cpp's KV cache types (ggml_type ids) for --llamacpp-kv-cache-type.
LLAMACPP_CACHE_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2, "q4_1": 3, "iq4_nl": 20, "q5_0": 6, "q5_1": 7}


def llamacpp_child(model: str, ctx: int, threads: int, chunks_path: str, cache_type: str = "f16") -> None:
    """Runs under the llama.cpp interpreter: NLLs of the scored positions, as JSON on stdout."""
    import numpy as np
    from llama_cpp import Llama

    chunks = json.loads(Path(chunks_path).read_text())
    kind = LLAMACPP_CACHE_TYPES[cache_type]
    # (a quantized V cache needs flash attention; the float16 one keeps llama.cpp's default)
    options = {} if cache_type == "f16" else {"flash_attn": True}
    llm = Llama(model_path=model, n_ctx=ctx, n_batch=ctx, n_threads=threads, logits_all=True,
                verbose=False, type_k=kind, type_v=kind, **options)
    nlls = []
    start = time.perf_counter()
    for chunk in chunks:
        llm.reset()
        llm.eval(chunk)
        logits = np.asarray(llm.scores[: len(chunk)], dtype=np.float64)
        top = logits.max(axis=1, keepdims=True)
        logprobs = logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
        for position in scored_positions(len(chunk)):
            # Row position - 1 predicts the token at position.
            nlls.append(float(-logprobs[position - 1, chunk[position]]))
    print(json.dumps({"nlls": nlls, "seconds": time.perf_counter() - start}))


def llamacpp_nlls(args: argparse.Namespace, model: str, chunks: list[list[int]], tmp: Path) -> tuple[list[float], float]:
    chunks_path = tmp / "perplexity_chunks.json"
    chunks_path.write_text(json.dumps(chunks))
    result = subprocess.run(
        [args.llamacpp_python, __file__, "--llamacpp-child", "--model", model, "--ctx", str(args.ctx),
         "--threads", str(args.threads), "--chunks-file", str(chunks_path),
         "--llamacpp-kv-cache-type", args.llamacpp_kv_cache_type],
        capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"llama.cpp run failed:\n{result.stderr[-2000:]}")
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    return figures["nlls"], figures["seconds"]


# ----------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a GGUF (default: the embedded default model)")
    parser.add_argument("--text", default=str(DEFAULT_TEXT), help="the text to score")
    parser.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default 512)")
    parser.add_argument("--max-chunks", type=int, help="score at most this many chunks")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="cadence: chunks per step (max_num_seqs)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--llamacpp-python", metavar="PYTHON",
                        help="an interpreter with llama-cpp-python: also run llama.cpp on the same ids")
    parser.add_argument("--llamacpp-kv-cache-type", default="f16", choices=sorted(LLAMACPP_CACHE_TYPES),
                        help="llama.cpp's K and V cache type (default f16)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures here")
    parser.add_argument("--llamacpp-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--chunks-file", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.llamacpp_child:
        llamacpp_child(args.model, args.ctx, args.threads, args.chunks_file, args.llamacpp_kv_cache_type)
        return 0
    from cadence.models.default_model import default_model_path

    model = args.model or default_model_path()
    ids, bos = tokenize(model, Path(args.text).read_text())
    chunks = chunks_of(ids, bos, args.ctx, args.max_chunks)
    report = {"model": os.path.basename(model), "text": os.path.basename(args.text),
              "text_tokens": len(ids), "ctx": args.ctx, "chunks": len(chunks),
              "cpu": platform.processor() or platform.machine(), "threads": args.threads,
              "command": "python bench/perplexity.py " + " ".join(sys.argv[1:])}
    nlls, seconds = cadence_nlls(args, chunks)
    report["cadence"] = {**perplexity(nlls), "seconds": seconds, "dtype": args.dtype,
                         "kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization}
    if args.llamacpp_python:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            reference, ref_seconds = llamacpp_nlls(args, model, chunks, Path(tmp))
        report["llama.cpp"] = {**perplexity(reference), "seconds": ref_seconds,
                               "kv_cache_type": args.llamacpp_kv_cache_type}
        report["cadence / llama.cpp"] = report["cadence"]["ppl"] / report["llama.cpp"]["ppl"]
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def print_report(report: dict) -> None:
    print(f"# perplexity of {report['model']} on {report['text']}: {report['chunks']} chunks of "
          f"{report['ctx']} tokens ({report['text_tokens']} in the text), the second half of each scored")
    print(f"command: {report['command']}")
    print("\n| engine | perplexity | ± | mean NLL | scored tokens | seconds |\n|---|---:|---:|---:|---:|---:|")
    for engine in ("cadence", "llama.cpp"):
        if engine in report:
            f = report[engine]
            print(f"| {engine} | {f['ppl']:.4f} | {f['ppl_stderr']:.4f} | {f['mean_nll']:.5f} | "
                  f"{f['num_scored']} | {f['seconds']:.1f} |")
    if "cadence / llama.cpp" in report:
        print(f"\ncadence / llama.cpp perplexity: {report['cadence / llama.cpp']:.4f}")


if __name__ == "__main__":
    sys.exit(main())
