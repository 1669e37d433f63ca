#!/usr/bin/env python3
"""Greedy streams with GGUF blocks kept against the same file dequantized (issue 32 item 3).

The 8 parity prompts of tests/engine/test_greedy_parity.py (through the
file's chat template, or as raw text where the file has none, as Gemma 3
270M's), greedy, EOS ignored, float32, in two engines in this process:
``quantization="auto"`` (blocks kept, the C kernel's integer products) and
``"none"`` (every weight dequantized to float32 at load). Prints how many
streams are equal and, for each that is not, the first token where they part.

    python bench/quant_parity.py
    python bench/quant_parity.py --model gemma-3-270m-q4_k_m.gguf --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cadence import LLM  # noqa: E402
from tests.engine.test_greedy_parity import GREEDY, QUESTIONS, conversation  # noqa: E402


def prompt_ids(tokenizer) -> list[dict]:
    if tokenizer.chat_template is None:
        return [{"prompt_token_ids": tokenizer.encode(question)} for question in QUESTIONS]
    texts = [tokenizer.apply_chat_template(conversation(question)) for question in QUESTIONS]
    return [{"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)} for text in texts]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a GGUF (default: the embedded default model)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    options = dict(dtype="float32", max_num_seqs=8, kv_cache_memory="128MiB")
    if args.model:
        options["model"] = args.model
    streams, kernels = {}, {}
    for mode in ("auto", "none"):
        llm = LLM(quantization=mode, **options)
        prompts = prompt_ids(llm.tokenizer)
        streams[mode] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        kernels[mode] = bool(llm.engine.core.runner.model.quantized_weights())
        del llm
    if not kernels["auto"]:
        print("auto kept no weight in blocks here (no C kernel): nothing to compare", file=sys.stderr)
        return 1
    parted = {}
    for i, (kept, dense) in enumerate(zip(streams["auto"], streams["none"])):
        if kept != dense:
            parted[i] = next(t for t, (a, b) in enumerate(zip(kept, dense)) if a != b)
    equal = len(QUESTIONS) - len(parted)
    name = Path(args.model).name if args.model else "default model"
    print(f"{name}: greedy streams equal, blocks kept vs dequantized: {equal} of {len(QUESTIONS)} "
          f"({GREEDY.max_tokens} tokens each)" + (f"; parted at token {parted}" if parted else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": name, "equal": equal, "of": len(QUESTIONS),
                                               "parted at": parted}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
