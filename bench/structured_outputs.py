#!/usr/bin/env python3
"""What structured outputs cost: grammar compile time, mask time per token per
request, and whole-run throughput with a JSON schema on every request against
none, at batch 64 on the default model (issue "Structured outputs and tool
calls", item 6; target: at most 10% fewer tokens/s).

The 64 user messages of ``cpu-throughput-v1`` (../shared/workloads), each
asking for a JSON answer, all submitted at once (max_num_seqs 64), greedy, on
2 threads. The constrained run goes first; the unconstrained run then makes
exactly the tokens each request made under the schema (``max_tokens`` = that
length, EOS ignored), so both runs have the same batch at every step and
differ only by the grammar's work. Runs alternate (schema, none, schema,
none, ...) so that drift on a shared machine hits both alike; the figure is
the median ratio over the pairs.

Timed inside the engine, per grammar row (a token of one request):
``fill``, the backend filling its bitmask row (in the scheduler), and
``apply``, the runner unpacking the rows and masking the logits.

    python bench/structured_outputs.py                      # both backends, 5 pairs each
    python bench/structured_outputs.py --backends llguidance --pairs 1 --num-prompts 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WORKLOAD_FILE = ROOT.parent / "shared" / "workloads" / "cpu-throughput-v1.json"
RESULTS = ROOT / "bench" / "results" / "structured_outputs.json"

SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 40},
        "summary": {"type": "string", "maxLength": 160},
        "sentiment": {"enum": ["positive", "neutral", "negative"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
        "source": {"type": "object",
                   "properties": {"kind": {"enum": ["book", "web", "memory"]},
                                  "year": {"type": "integer", "minimum": 1900, "maximum": 2030}},
                   "required": ["kind", "year"]},
    },
    "required": ["topic", "summary", "sentiment", "confidence", "keywords", "source"],
}


class Timer:
    """Seconds and calls spent in one function, by wrapping it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.rows = 0

    def wrap(self, fn, count_rows):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            self.seconds += time.perf_counter() - start
            self.rows += count_rows(args, kwargs, result)
            return result
        return timed

    def per_row_us(self) -> float | None:
        return self.seconds / self.rows * 1e6 if self.rows else None


def compile_times(backend_name: str, tokenizer, vocab_size: int) -> dict:
    from cadence.sampling_params import StructuredOutputParams
    from cadence.structured import make_grammar_backend

    backend = make_grammar_backend(backend_name, tokenizer, vocab_size)
    params = StructuredOutputParams(json=SCHEMA)
    start = time.perf_counter()
    backend.compile(params)
    first = time.perf_counter() - start  # includes the tokenizer tables
    other = StructuredOutputParams(json={**SCHEMA, "title": "another schema"})
    start = time.perf_counter()
    backend.compile(other)
    new_schema = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(100):
        backend.compile(params)
    cached = (time.perf_counter() - start) / 100
    return {"first_s": first, "new_schema_s": new_schema, "cached_s": cached}


def run_backend(backend_name: str, args) -> dict:
    import torch

    from cadence import LLM, SamplingParams
    from cadence.runner import model_runner

    torch.set_num_threads(args.threads)
    # No prefix caching: every run prefills its prompts (a run after another would
    # find them cached and skip its prefill).
    llm = LLM(dtype=args.dtype, max_num_seqs=args.num_prompts, kv_cache_memory="1GiB",
              max_model_len=1024, structured_outputs_backend=backend_name,
              enable_prefix_caching=False)
    tokenizer = llm.tokenizer
    messages = json.loads(WORKLOAD_FILE.read_text())["user_messages"][: args.num_prompts]
    conversations = [[{"role": "user", "content": f"{m}\nAnswer with a JSON object."}]
                     for m in messages]
    prompts = [{"prompt_token_ids": tokenizer.encode(
        tokenizer.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False)}
        for c in conversations]
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                 structured_outputs={"json": SCHEMA})
    # Warm-up, the grammar's too: the backend's tokenizer tables are built on the
    # first structured request (timed apart, in "compile").
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)
    llm.generate(prompts[:2], constrained.replace(max_tokens=4), use_tqdm=False)

    fill, apply = Timer(), Timer()
    manager = llm.engine.core.scheduler.structured_output_manager
    manager.grammar_bitmask = fill.wrap(
        manager.grammar_bitmask, lambda a, kw, result: 0 if result is None else len(result))
    original_apply = model_runner.apply_grammar_bitmask
    model_runner.apply_grammar_bitmask = apply.wrap(original_apply, lambda a, kw, result: len(a[2]))

    pairs = []
    for _ in range(args.pairs):
        start = time.perf_counter()
        outs = llm.generate(prompts, constrained, use_tqdm=False)
        with_schema_s = time.perf_counter() - start
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        valid = sum(_is_json(o.outputs[0].text) for o in outs)
        plain = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        start = time.perf_counter()
        plain_outs = llm.generate(prompts, plain, use_tqdm=False)
        without_s = time.perf_counter() - start
        assert [len(o.outputs[0].token_ids) for o in plain_outs] == lengths
        tokens = sum(lengths)
        pairs.append({"tokens": tokens, "valid_json": valid, "schema_s": with_schema_s,
                      "none_s": without_s, "schema_tok_s": tokens / with_schema_s,
                      "none_tok_s": tokens / without_s, "ratio": without_s / with_schema_s})
        print(f"  {backend_name}: {tokens} tokens, {valid}/{len(outs)} valid JSON; "
              f"schema {tokens / with_schema_s:.1f} tok/s, none {tokens / without_s:.1f} tok/s, "
              f"ratio {without_s / with_schema_s:.3f}", file=sys.stderr)
    model_runner.apply_grammar_bitmask = original_apply
    return {
        "backend": backend_name,
        # A fresh backend: "first" includes building its tokenizer tables.
        "compile": compile_times(backend_name, tokenizer, llm.engine.model_config.vocab_size),
        "fill_us_per_row": fill.per_row_us(), "apply_us_per_row": apply.per_row_us(),
        "pairs": pairs, "median_ratio": statistics.median(p["ratio"] for p in pairs),
    }


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="llguidance,xgrammar")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = {"machine": os.uname().nodename, "cpus": os.cpu_count(), "args": {
        k: str(v) for k, v in vars(args).items()}, "runs": []}
    for name in args.backends.split(","):
        result = run_backend(name, args)
        results["runs"].append(result)
        c = result["compile"]
        print(f"{name}: throughput with a schema / without = {result['median_ratio']:.3f} "
              f"(median of {len(result['pairs'])}); mask fill {result['fill_us_per_row']:.1f} us/row, "
              f"apply {result['apply_us_per_row']:.1f} us/row; compile first {c['first_s'] * 1e3:.0f} ms, "
              f"new schema {c['new_schema_s'] * 1e3:.1f} ms, cached {c['cached_s'] * 1e6:.1f} us")
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
