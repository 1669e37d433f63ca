#!/usr/bin/env python3
"""Tensor parallelism on the CPU: the same batch on K = 1, 2, ... ranks.

A random Llama of a chosen shape (default: 16 heads, 8 KV heads, hidden
1024, 8 layers, 32k vocabulary: ~200M parameters) written as a Hugging Face
folder, served by ``LLM(folder, tensor_parallel_size=K)`` for each K with
the same total threads (``--threads``, split among the ranks). Greedy, a
fixed number of new tokens per prompt (EOS ignored), all prompts at once,
after a warm-up. Prints output tokens/s per K, the ratio to K = 1, and
whether every K gave K = 1's tokens.

On one CPU socket the ranks share the memory bandwidth that decode is
bound by, so K > 1 mostly measures the cost of the collectives (gloo over
the loopback) and of running the step loop once per rank; the split pays
where each rank has its own memory (sockets, NUMA nodes, GPUs).

    python bench/tensor_parallel.py                    # K = 1, 2 (a few minutes)
    python bench/tensor_parallel.py --quick            # a tiny shape, seconds (a smoke test)
    python bench/tensor_parallel.py --sizes 1,2,4 --threads 8
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=8, head_dim=64, vocab_size=32000, max_position_embeddings=4096)
QUICK_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1,2", help="tensor_parallel_size values, comma-separated")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads of the whole engine (split among its ranks)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="a tiny model, 4 prompts x 8 tokens")
    return parser.parse_args()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def run(folder: str, size: int, args: argparse.Namespace, prompts: list[dict]) -> tuple[float, list]:
    """(output tokens/s, the tokens) of one engine of ``size`` ranks."""
    from cadence import LLM, SamplingParams

    llm = LLM(folder, dtype="float32", tensor_parallel_size=size, num_threads=args.threads,
              max_num_seqs=len(prompts), max_model_len=args.prompt_len + args.max_tokens + 16,
              kv_cache_memory="1GiB")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    llm.engine.core.shutdown()
    tokens = [list(out.outputs[0].token_ids) for out in outputs]
    return sum(map(len, tokens)) / elapsed, tokens


def main() -> int:
    args = parse_args()
    if args.quick:
        args.prompts, args.prompt_len, args.max_tokens = 4, 16, 8
    shape = QUICK_SHAPE if args.quick else SHAPE
    sizes = [int(s) for s in args.sizes.split(",")]
    print("command:", " ".join([sys.executable, *sys.argv]))
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores; engine threads {args.threads}")
    print(f"model: random llama {shape}; {args.prompts} prompts x {args.prompt_len} tokens, "
          f"{args.max_tokens} new tokens each, greedy")
    from cadence.models.testing import random_model, tiny_config, write_hf_folder

    vocab = shape["vocab_size"]
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % vocab for j in range(args.prompt_len)]}
               for i in range(args.prompts)]
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        write_hf_folder(folder, random_model(tiny_config(**shape), seed=0))
        for size in sizes:
            results[size] = run(folder, size, args, prompts)
    base_rate, base_tokens = results[sizes[0]]
    print(f"\n| tensor_parallel_size | output tok/s | vs K={sizes[0]} | same tokens as K={sizes[0]} |")
    print("|---|---|---|---|")
    for size, (rate, tokens) in results.items():
        print(f"| {size} | {rate:.1f} | {rate / base_rate:.2f}x | {'yes' if tokens == base_tokens else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
