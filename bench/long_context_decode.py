"""Decode tokens/s after a long prompt, through the engine with every default (one checkout).

    python bench/long_context_decode.py CHECKOUT MODEL PROMPT_TOKENS [SEQUENCES]
    python bench/long_context_decode.py . default 1000          # the embedded SmolLM2, one stream
    python bench/long_context_decode.py ../base-tree gemma-3-270m-q4_k_m.gguf 400 32

Runs ``CHECKOUT``'s cadence (its own kernels): ``SEQUENCES`` prompts of
``PROMPT_TOKENS`` token ids (distinct per sequence), 64 greedy tokens each,
EOS ignored; prints the best of two runs of the output tokens/s over the last
60 steps (``SEQUENCES`` x 59 tokens: decode steps once the prompts are in).
Run two checkouts alternately, one process each, and compare the ratios: the
machine's speed drifts between minutes.
"""

from __future__ import annotations

import sys
import time

DECODE_TOKENS = 64
TIMED_STEPS = 60


def main() -> None:
    checkout, model, prompt_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    sequences = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    sys.path.insert(0, checkout)
    from cadence import SamplingParams
    from cadence.engine.llm import LLM

    llm = LLM(None if model == "default" else model)
    prompts = [[100 + (i * 7 + j * 13) % 4000 for j in range(prompt_tokens)] for i in range(sequences)]
    warm = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
    llm.generate([{"prompt_token_ids": p} for p in prompts], warm, use_tqdm=False)
    params = SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True, temperature=0.0)
    core, step_ends = llm.engine.core, []
    step = core.step
    core.step = lambda: (step(), step_ends.append(time.perf_counter()))[0]
    best = 0.0
    for run in range(2):
        step_ends.clear()  # (a different first token per run: no prefix is cached)
        llm.generate([{"prompt_token_ids": [run + 5] + p} for p in prompts], params, use_tqdm=False)
        elapsed = step_ends[-1] - step_ends[-TIMED_STEPS]
        best = max(best, sequences * (TIMED_STEPS - 1) / elapsed)
    print(f"{best:.1f}")


if __name__ == "__main__":
    main()
