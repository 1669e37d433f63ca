#!/usr/bin/env python3
"""lora-v1: throughput of a batch mixing 4 LoRA adapters against the base model alone.

On the default model (SmolLM2-135M), 4 random PEFT adapters (rank 16 by
default, on all 7 projections of every layer) are written to a temporary
folder. Three engines run the same greedy batch (prompt caching off, so
repeats cost the same):

    base            an engine without LoRA, every request on the base model
    lora, base rows an engine with --enable-lora, every request on the base model
    lora, 4 mixed   the same engine, request i under adapter i % 4 (max_loras 4)

Each configuration runs ``--repeats`` times in alternation (the machine is
shared and noisy); the median, min and max tokens/s are printed, and the
ratio of medians to the base. Results go to bench/results/lora.json.

    python bench/lora.py                          # batch 32, 64 tokens, 3 repeats
    python bench/lora.py --batch 8 --max-tokens 32 --repeats 2 --rank 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "lora.json"
NUM_ADAPTERS = 4

TOPICS = ["the ocean", "a lighthouse", "bread", "databases", "autumn", "airplanes", "chess",
          "volcanoes", "libraries", "bicycles", "coffee", "the moon", "rivers", "music",
          "gardens", "trains"]


def prompts(batch: int) -> list[str]:
    return [f"Write a few sentences about {TOPICS[i % len(TOPICS)]} (note {i})." for i in range(batch)]


def write_adapters(folder: str, rank: int) -> list[str]:
    from cadence.models.default_model import default_model_path
    from cadence.models.gguf_loader import gguf_model_config, read_gguf
    from cadence.models.testing import write_random_adapter

    config = gguf_model_config(*read_gguf(default_model_path()))
    paths = []
    for i in range(NUM_ADAPTERS):
        path = f"{folder}/adapter{i + 1}"
        write_random_adapter(path, config, rank=rank, alpha=2 * rank, seed=i + 1, std=0.02)
        paths.append(path)
    return paths


def run_once(llm, batch: int, max_tokens: int, loras) -> float:
    """Output tokens per second of one batch."""
    from cadence.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts(batch), params, lora_request=loras, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from cadence.core.request import LoRARequest
    from cadence.engine.llm import LLM

    common = dict(num_threads=args.threads, enable_prefix_caching=False,
                  max_num_seqs=max(args.batch, 1), max_model_len=512)
    with tempfile.TemporaryDirectory(prefix="cadence-lora-bench-") as folder:
        paths = write_adapters(folder, args.rank)
        adapters = [LoRARequest(f"adapter{i + 1}", i + 1, p) for i, p in enumerate(paths)]
        base = LLM(**common)
        lora = LLM(enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=args.rank, **common)
        mixed = [adapters[i % NUM_ADAPTERS] for i in range(args.batch)]
        configs = {"base": (base, None), "lora, base rows": (lora, None),
                   "lora, 4 mixed": (lora, mixed)}
        warm = min(args.batch, NUM_ADAPTERS)
        for llm, loras in configs.values():  # warm-up (adapters loaded, kernels built)
            run_once(llm, warm, 4, loras[:warm] if loras else None)
        figures: dict[str, list[float]] = {name: [] for name in configs}
        for _ in range(args.repeats):
            for name, (llm, loras) in configs.items():
                figures[name].append(run_once(llm, args.batch, args.max_tokens, loras))
    report(figures, args)
    return 0


def report(figures: dict[str, list[float]], args: argparse.Namespace) -> None:
    base_median = statistics.median(figures["base"])
    print(f"batch {args.batch}, {args.max_tokens} tokens, rank {args.rank}, {args.threads} threads, "
          f"{args.repeats} repeats (output tokens/s)")
    rows = {}
    for name, values in figures.items():
        median = statistics.median(values)
        rows[name] = {"median": median, "min": min(values), "max": max(values), "runs": values,
                      "ratio_to_base": median / base_median}
        print(f"  {name:16s} median {median:7.1f}  min {min(values):7.1f}  max {max(values):7.1f}"
              f"  ratio {median / base_median:.3f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
