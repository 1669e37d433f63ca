#!/usr/bin/env python3
"""batch-invariance-v1: what the batch-invariant mode costs (``--batch-invariant on`` against off).

Two engines in one process, the same model and options but ``batch_invariant``
on and off, run in alternation (the machine may be shared: each figure is
the best of ``--repeats``):

    batch 64        the 64 chat prompts of cpu-throughput-v1 (34-48 tokens), all
                    at once, greedy, exactly --max-tokens new tokens each
    single stream   the first of them alone, the same number of tokens
    prefill         one 2,000-token prompt (the workload's prompts end to end), one
                    new token: prompt tokens/s

One line comes out (figures in tokens/s; cost = 1 - on / off):

    batch-invariance-v1 default model auto quantization auto, 2 threads, 128 tokens, best of 3:
    batch 64 on 512.3 off 520.1 (cost 1.5%); single stream on ... (cost ...%); prefill 2000
    on ... (cost ...%); auto: batch-invariant mode off (auto: ...)

The rule ``batch_invariant=auto`` follows (``cadence/runner/batch_invariance.py``)
is written from these figures: on where the batch-64 and single-stream costs
are under 5% (the prefill figure is recorded beside them).

    python bench/batch_invariance.py                                  # default model, float32
    python bench/batch_invariance.py --quantization none              # the same weights dense
    python bench/batch_invariance.py --quantization none --dtype bfloat16
    python bench/batch_invariance.py --quick                          # 8 tokens, 1 repeat: a smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

BATCH = 64
PREFILL_TOKENS = 2000


def tokens_per_second(llm, prompt_ids: list[list[int]], max_tokens: int, *, prompt: bool = False) -> float:
    """Output tokens/s of one greedy batch (``prompt``: prompt tokens/s)."""
    from cadence.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    counts = [len(out.outputs[0].token_ids) for out in outputs]
    assert counts == [max_tokens] * len(prompt_ids), counts
    return (sum(map(len, prompt_ids)) if prompt else sum(counts)) / elapsed


def make_engine(args: argparse.Namespace, mode: str, num_tokens: int):
    """An engine with ``batch_invariant=mode``, and what the mode resolved to."""
    from cadence.engine.llm import LLM

    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, batch_invariant=mode,
              num_threads=args.num_threads, max_num_seqs=BATCH, max_num_batched_tokens=4096,
              num_gpu_blocks=-(-num_tokens // 16) + BATCH, enable_prefix_caching=False)
    return llm, llm.engine.core.runner.batch_invariance.describe()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF or HF folder (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="8 tokens, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.max_tokens, args.repeats = 8, 1

    from throughput import workload_prompt_ids

    from cadence.models.default_model import default_model_path

    prompt_ids = workload_prompt_ids(default_model_path(), BATCH)
    long_prompt = [token for ids in prompt_ids for token in ids][:PREFILL_TOKENS]
    num_tokens = sum(len(p) + args.max_tokens for p in prompt_ids) + PREFILL_TOKENS
    engines = {mode: make_engine(args, mode, num_tokens) for mode in ("on", "off")}
    best: dict[tuple[str, str], float] = {}
    for llm, _ in engines.values():
        tokens_per_second(llm, prompt_ids[:2], 4)  # warm-up: kernels built, pages touched
    for _ in range(args.repeats):
        for mode, (llm, _) in engines.items():
            figures = {"batch": tokens_per_second(llm, prompt_ids, args.max_tokens),
                       "single": tokens_per_second(llm, prompt_ids[:1], args.max_tokens),
                       "prefill": tokens_per_second(llm, [long_prompt], 1, prompt=True)}
            for name, figure in figures.items():
                best[mode, name] = max(best.get((mode, name), 0.0), figure)
    cost = lambda name: 100 * (1 - best["on", name] / best["off", name])  # noqa: E731
    model = args.model or "default model"
    print(f"batch-invariance-v1 {model} {args.dtype} quantization {args.quantization}, "
          f"{args.num_threads} threads, {args.max_tokens} tokens, best of {args.repeats}: "
          f"batch {BATCH} on {best['on', 'batch']:.1f} off {best['off', 'batch']:.1f} "
          f"(cost {cost('batch'):.1f}%); single stream on {best['on', 'single']:.1f} "
          f"off {best['off', 'single']:.1f} (cost {cost('single'):.1f}%); prefill {PREFILL_TOKENS} "
          f"on {best['on', 'prefill']:.1f} off {best['off', 'prefill']:.1f} (cost {cost('prefill'):.1f}%); "
          f"auto: {make_engine(args, 'auto', num_tokens)[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
