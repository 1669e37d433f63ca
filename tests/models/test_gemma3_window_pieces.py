"""A long prompt's prefill on the real Gemma 3 270M file, whose 15 local layers
attend over a 512-token window: the attention of those layers runs in pieces
of ``WINDOW_PIECE_QUERY_LEN`` query tokens that each read only their window,
and gives the tokens one whole masked call per layer gives."""

from __future__ import annotations

from pathlib import Path

import pytest

from cadence.engine.llm import LLM
from cadence.runner import attention
from cadence.sampling_params import SamplingParams
from tests.models.gemma3_file import gemma3_path

PROMPT_TOKENS = 1400  # past the window and several pieces, in one step


@pytest.fixture(scope="module")
def llm():
    # Weights decoded at load: no rounding of activations to the products' integer steps, whose
    # boundaries a float32 sum taken in another order can cross, so the attention alone differs;
    # the batch-invariant mode (on by default for float weights) would take the native kernel.
    return LLM(model=gemma3_path(), dtype="float32", quantization="none", batch_invariant="off",
               max_model_len=2048, max_num_batched_tokens=2048, num_threads=2, enable_prefix_caching=False)


def test_window_pieces_give_the_tokens_of_one_whole_call(llm, monkeypatch):
    text = (Path(__file__).parents[2] / "bench" / "data" / "perplexity.txt").read_text()
    prompt = {"prompt_token_ids": llm.tokenizer.encode(text)[:PROMPT_TOKENS]}
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    planned = []  # each long query's (first, end) query row, as planned
    plan = attention._plan_prefill

    def noting(query_start, query_len, *args):
        planned.append((query_start, query_start + query_len))
        return plan(query_start, query_len, *args)

    monkeypatch.setattr(attention, "_plan_prefill", noting)
    runs, plans = {}, {}
    for piece in (attention.WINDOW_PIECE_QUERY_LEN, 10**9):
        monkeypatch.setattr(attention, "WINDOW_PIECE_QUERY_LEN", piece)
        planned.clear()
        runs[piece] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        plans[piece] = set(planned)
    pieces, whole = runs.values()
    # The local layers' plan: six pieces (the global layers' is the whole query).
    assert plans[256] == {(0, PROMPT_TOKENS), *((j, min(j + 256, PROMPT_TOKENS)) for j in range(0, PROMPT_TOKENS, 256))}
    assert plans[10**9] == {(0, PROMPT_TOKENS)}
    assert pieces.token_ids == whole.token_ids
    first_token = whole.token_ids[0]
    assert pieces.logprobs[0][first_token].logprob == pytest.approx(whole.logprobs[0][first_token].logprob, abs=2e-3)
