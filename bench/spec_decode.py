#!/usr/bin/env python3
"""Does n-gram speculative decoding pay? Tokens/s and draft acceptance on a
workload where it should (the answer repeats the prompt) and one where it
should not (open questions), at batch 1 and batch 16, for: no speculation,
speculation that always drafts (``draft_acceptance_floor`` 0), a fixed floor
of 0.3 (a request whose drafts keep failing stops drafting for a while), and
the default: the floor is the break-even acceptance measured from the
engine's own steps (cadence/runner/draft_gate.py).

Greedy, on the default model, 2 threads; every configuration's outputs must
equal the unspeculated ones token for token (speculation may not change a
greedy answer), and each configuration runs twice in alternation, the best
of the two kept (these machines are noisy).

    python bench/spec_decode.py                 # the whole table (minutes)
    python bench/spec_decode.py --batches 1 --max-tokens 64
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
RESULTS = ROOT / "bench" / "results" / "spec_decode.json"

PARAGRAPHS = [
    "The old lighthouse stood on the northern cliff for more than a century, guiding fishing "
    "boats home through fog and storms. Its keeper climbed the spiral stairs every evening to "
    "light the lamp, and every morning he wrote the weather in a leather book.",
    "Our team meets every Monday at nine to plan the week. We review the open tickets, agree on "
    "priorities and assign each task to one person. On Friday we demo what we finished and write "
    "down what we learned.",
    "To bake the bread, mix the flour, water, salt and yeast in a large bowl. Knead the dough for "
    "ten minutes, let it rise for two hours, shape it into a loaf and bake it at two hundred "
    "degrees for forty minutes.",
    "The museum opens at ten in the morning and closes at six in the evening. Tickets cost twelve "
    "euros for adults and six for children. Guided tours start every hour from the main hall.",
]
SWAPS = [("northern", "southern"), ("Monday", "Tuesday"), ("large", "small"), ("ten", "nine")]
QUESTIONS = [
    "Why do cats sleep so much?", "Give me three ideas for a birthday party.",
    "What makes a good teacher?", "How do airplanes stay in the air?",
    "Write a short poem about autumn.", "What should I pack for a hiking trip?",
    "Explain what a database index is.", "Why is the ocean salty?",
]
CONFIGS = {  # name: engine options
    "no speculation": {},
    "always draft": {"num_speculative_tokens": 3, "draft_acceptance_floor": 0.0},
    "floor 0.3": {"num_speculative_tokens": 3, "draft_acceptance_floor": 0.3},
    "measured (default)": {"num_speculative_tokens": 3},
}


def workloads(num: int) -> dict[str, list[list[dict]]]:
    repeat = [[{"role": "user", "content": f"Rewrite this paragraph, changing only the word "
                f"\"{a}\" to \"{b}\":\n\n{p}"}] for p, (a, b) in zip(PARAGRAPHS, SWAPS)]
    open_ = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return {"repeat": (repeat * num)[:num], "open": (open_ * num)[:num]}


def run_config(name: str, options: dict, args) -> dict:
    import torch

    from cadence import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(dtype=args.dtype, max_num_seqs=max(args.batches), kv_cache_memory="512MiB",
              max_model_len=1024, **options)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llm.generate(["Hello"], SamplingParams(max_tokens=4), use_tqdm=False)
    rows = {}
    for batch in args.batches:
        for workload, conversations in workloads(batch).items():
            best = None
            for _ in range(args.repeats):
                llm.spec_decoding_stats = None
                start = time.perf_counter()
                outs = llm.chat(conversations, params, use_tqdm=False)
                seconds = time.perf_counter() - start
                tokens = [o.outputs[0].token_ids for o in outs]
                spec = llm.spec_decoding_stats
                result = {"seconds": seconds, "tokens": sum(map(len, tokens)),
                          "tok_s": sum(map(len, tokens)) / seconds, "token_ids": tokens,
                          "acceptance_rate": spec.acceptance_rate if spec else None,
                          "mean_acceptance_length": spec.mean_acceptance_length if spec else None,
                          "num_drafts": spec.num_drafts if spec else 0}
                if best is None or result["tok_s"] > best["tok_s"]:
                    best = result
            rows[f"{workload}@{batch}"] = best
            print(f"  {name:20s} {workload:6s} batch {batch:2d}: {best['tok_s']:7.1f} tok/s, "
                  f"acceptance {best['acceptance_rate'] or 0:.2f}, "
                  f"mean length {best['mean_acceptance_length'] or 1:.2f}", file=sys.stderr)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = {name: run_config(name, options, args) for name, options in CONFIGS.items()}
    base = results["no speculation"]
    print(f"{'workload':10s} {'config':20s} {'tok/s':>8s} {'vs none':>8s} {'accept':>7s} {'length':>7s}")
    for key in base:
        for name, rows in results.items():
            row = rows[key]
            same = row["token_ids"] == base[key]["token_ids"]
            print(f"{key:10s} {name:20s} {row['tok_s']:8.1f} {row['tok_s'] / base[key]['tok_s']:8.2f} "
                  f"{row['acceptance_rate'] or 0:7.2f} {row['mean_acceptance_length'] or 1:7.2f}"
                  f"{'' if same else '  OUTPUT DIFFERS'}")
    for rows in results.values():
        for row in rows.values():
            row.pop("token_ids")
    args.out.write_text(json.dumps({"machine": os.uname().nodename, "args": {
        k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))


if __name__ == "__main__":
    main()
