"""Gemma 3 270M Q4_K_M, a real GGUF no one here made (tests/models/gemma3_file.py):
it loads with every matrix kept in its blocks, and its greedy tokens are
transformers' on the same file dequantized, in float32, alone and in a batch (up
to a near tie, kept in blocks; to the end, decoded at load)."""

from __future__ import annotations

import pytest

from cadence.engine.llm import LLM
from cadence.models import load_model
from cadence.models.gguf_loader import read_gguf
from cadence.models.quantized import QuantizedTensor, keeps_quantized
from cadence.sampling_params import SamplingParams
from tests.models.gemma3_file import gemma3_path, recorded_reference


@pytest.fixture(scope="module")
def path():
    return gemma3_path()


@pytest.fixture(scope="module")
def llm(path):
    return LLM(model=path, dtype="float32", kv_cache_memory="64MiB", max_model_len=512, max_num_seqs=4,
               num_threads=2)


def test_every_matrix_stays_in_its_blocks(path):
    import torch

    model, _, config = load_model(path, torch.float32, "auto")
    reader, _ = read_gguf(path)
    matrices = [t for t in reader.tensors if len(t.shape) == 2]
    assert config.architecture == "gemma3_text" and config.num_hidden_layers == 18
    assert len(matrices) == 18 * 7 + 1  # q k v o gate up down per layer, the embedding
    assert all(keeps_quantized(t.name, t.tensor_type, "auto") for t in matrices)
    assert model.dequantized_at_load == {}
    parts = model.quantized_weights()  # q/k/v and gate/up share a part where their types match
    assert all(isinstance(part, QuantizedTensor) for part in parts)
    assert sum(part.nbytes for part in parts) == sum(t.n_bytes for t in matrices)


# The reference's token 11 is a near tie: the float32 model's top two differ by 0.014
# nats there (7488 at -1.8505, 5279 at -1.8644). The Q4_K and Q6_K products round x
# to int8 steps, as llama.cpp's do, which moves those two by more (5279 leads by
# 0.06): kept in blocks, the greedy stream is transformers' up to that token.
NEAR_TIE = 11


def test_greedy_tokens_equal_transformers(llm):
    reference = recorded_reference()
    assert llm.tokenizer.encode(reference["prompt"]) == reference["prompt_token_ids"]
    expected = reference["greedy_token_ids"][:NEAR_TIE]
    params = SamplingParams(max_tokens=NEAR_TIE, temperature=0.0, ignore_eos=True)
    prompt = {"prompt_token_ids": reference["prompt_token_ids"]}
    alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert list(alone) == expected
    others = [{"prompt_token_ids": reference["prompt_token_ids"][:1] + ids}
              for ids in ([1437, 9145, 563], [2094, 236789, 236751, 3074], [818, 1595])]
    batched = llm.generate([others[0], prompt, *others[1:]], params, use_tqdm=False)
    assert list(batched[1].outputs[0].token_ids) == expected


def test_dequantized_greedy_tokens_equal_transformers_to_the_end(path):
    """Every weight decoded to float32 at load (``quantization="none"``), as transformers
    ran it: all 40 tokens, past the near tie."""
    reference = recorded_reference()
    llm = LLM(model=path, dtype="float32", quantization="none", kv_cache_memory="64MiB", max_model_len=512,
              max_num_seqs=1, num_threads=2)
    params = SamplingParams(max_tokens=len(reference["greedy_token_ids"]), temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": reference["prompt_token_ids"]}], params, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == reference["greedy_token_ids"]


def test_decodes_take_the_one_call_decoder_equal_to_the_layer_by_layer_path(llm):
    """Its decode steps run through all 18 layers in one C call (sandwich and offset
    norms, GeGLU, q/k norms, local rotary tables and windows beside global layers),
    and the tokens are those of the modules, layer by layer."""
    runner = llm.engine.core.runner
    fused = runner.fused_decoder
    assert fused is not None, runner.fused_decoder_note
    calls = []
    forward = fused.forward
    fused.forward = lambda *args: calls.append(1) or forward(*args)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["Write a haiku about the sea.", "List three prime numbers:"]
    try:
        one_call = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert len(calls) >= 20
        runner.fused_decoder = None
        layer_by_layer = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        fused.forward = forward
        runner.fused_decoder = fused
    assert one_call == layer_by_layer
