"""Tensor parallelism through ``LLM``: K = 2 ranks over gloo give the tokens of K = 1.

Tiny random Llamas written as Hugging Face folders (``write_hf_folder``):
multi-head (4:4) and grouped-query (4:2 heads, so each rank holds one KV
head); tests/models/test_tensor_parallel_model.py splits each family's
blocks. Each K = 2 engine starts one worker process; the workers must exit
with their engine, and a worker that dies must fail the next step with an
error, not hang it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from cadence.config import EngineOptions
from cadence.runner.device_setup import check_tensor_parallel_options
from cadence.engine.llm import LLM
from cadence.models.tensor_parallel import check_tensor_parallel
from cadence.models.testing import random_model, tiny_config, write_hf_folder
from cadence.runner.tp_workers import WorkerFailed
from cadence.sampling_params import SamplingParams, StructuredOutputParams

PROMPTS = [{"prompt_token_ids": list(range(5 + i, 30 + 7 * i))} for i in range(4)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
MODELS = {
    "mha": dict(num_key_value_heads=4),
    "gqa": dict(),
}


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """A K-rank engine sets this process's threads to its share: put them back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_models")
    for name, overrides in MODELS.items():
        write_hf_folder(str(root / name), random_model(tiny_config(**overrides), seed=3))
    return {name: str(root / name) for name in MODELS}


def make_llm(folder: str, tensor_parallel_size: int, **options) -> LLM:
    return LLM(folder, dtype="float32", num_gpu_blocks=64, max_model_len=256, max_num_seqs=4,
               num_threads=2, tensor_parallel_size=tensor_parallel_size, **options)


def generate(llm: LLM, params=GREEDY, prompts=PROMPTS):
    return llm.generate(prompts, params, use_tqdm=False)


def token_ids(outputs) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in outputs]


def worker_pids(llm: LLM) -> list[int]:
    return llm.engine.core.runner.workers.pids()


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    """The pids still alive (not zombies) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pid for pid in pids if _alive(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("model, options", [("mha", {}), ("gqa", {"async_scheduling": True}),
                                            ("gqa", {"kv_cache_dtype": "float16"})])
def test_two_ranks_give_the_tokens_of_one_and_exit_with_the_engine(folders, model, options):
    cache = {k: v for k, v in options.items() if k == "kv_cache_dtype"}  # each rank's cache, and one rank's
    expected = token_ids(generate(make_llm(folders[model], 1, **cache)))
    llm = make_llm(folders[model], 2, **options)
    pids = worker_pids(llm)
    try:
        assert pids and all(map(_alive, pids))
        assert token_ids(generate(llm)) == expected
        if cache:
            assert llm.engine.core.runner.kv_cache.data.dtype == torch.float16
    finally:
        llm.engine.core.shutdown()
    assert wait_gone(pids) == []


def test_sampling_drafts_grammars_and_logprobs_match_one_rank(folders):
    """Seeded random sampling, n-gram drafts, a grammar and prompt logprobs:
    rank 0 samples, drafts and masks, the worker follows; the results are those of one rank."""
    seeded = [SamplingParams(max_tokens=10, temperature=0.8, seed=i, ignore_eos=True, prompt_logprobs=2)
              for i in range(len(PROMPTS))]
    repetitive = [{"prompt_token_ids": [7, 8, 9, 10] * 6}, *PROMPTS[:2]]
    regex = SamplingParams(max_tokens=8, temperature=0, structured_outputs=StructuredOutputParams(
        regex="[a-c]{3}[0-9]+"))
    one = make_llm(folders["gqa"], 1, num_speculative_tokens=3)
    expected, expected_drafted = generate(one, seeded), token_ids(generate(one, prompts=repetitive))
    expected_text = generate(one, regex, PROMPTS[:1])[0].outputs[0].text
    llm = make_llm(folders["gqa"], 2, num_speculative_tokens=3)
    try:
        outputs = generate(llm, seeded)
        assert token_ids(outputs) == token_ids(expected)
        for got, want in zip(outputs, expected):  # the same tokens ranked, to float rounding
            for got_row, want_row in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
                assert sorted(got_row) == sorted(want_row)
                assert [got_row[t].logprob for t in sorted(got_row)] == pytest.approx(
                    [want_row[t].logprob for t in sorted(want_row)], abs=1e-4)
        assert token_ids(generate(llm, prompts=repetitive)) == expected_drafted
        assert llm.spec_decoding_stats is not None and llm.spec_decoding_stats.num_drafts > 0
        text = generate(llm, regex, PROMPTS[:1])[0].outputs[0].text
        assert text == expected_text and re.fullmatch("[a-c]{3}[0-9]+", text)
    finally:
        llm.engine.core.shutdown()


def test_workers_exit_when_the_engine_process_is_killed(folders):
    script = textwrap.dedent(f"""
        from cadence.engine.llm import LLM
        llm = LLM({folders['gqa']!r}, dtype="float32", num_gpu_blocks=16, max_model_len=128,
                  num_threads=2, tensor_parallel_size=2)
        print(*llm.engine.core.runner.workers.pids(), flush=True)
        import time; time.sleep(120)
    """)
    engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in engine.stdout.readline().split()]
        assert pids and all(map(_alive, pids))
    finally:
        engine.kill()
        engine.wait()
    assert wait_gone(pids) == []


def test_a_dead_worker_fails_the_step_instead_of_hanging(folders):
    llm = make_llm(folders["gqa"], 2)
    try:
        generate(llm)
        os.kill(worker_pids(llm)[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerFailed, match="worker rank 1 failed .*exited with code -9"):
            generate(llm)
        assert time.monotonic() - start < 30
    finally:
        llm.engine.core.shutdown()


@pytest.mark.parametrize("overrides, size, message", [
    (dict(num_attention_heads=6, num_key_value_heads=6), 4, "num_attention_heads 6"),
    (dict(num_key_value_heads=1), 2, "num_key_value_heads 1"),
    (dict(num_key_value_heads=4, intermediate_size=130), 4, "intermediate_size 130"),
])
def test_heads_that_do_not_divide_are_refused(overrides, size, message):
    with pytest.raises(ValueError, match=f"tensor_parallel_size {size}: llama has {message}"):
        check_tensor_parallel(tiny_config(**overrides), size)


def test_the_llm_refuses_a_split_that_does_not_divide(folders):
    with pytest.raises(ValueError, match="tensor_parallel_size 3: llama has num_attention_heads 4"):
        make_llm(folders["mha"], 3)


@pytest.mark.parametrize("overrides, message", [
    (dict(architecture="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
     "qwen3_moe is a mixture of experts"),
    (dict(architecture="olmo2", qk_norm="whole", norm_placement="post"),
     "olmo2 norms q and k over all heads"),
])
def test_architectures_it_cannot_split_are_refused(overrides, message):
    with pytest.raises(ValueError, match=f"tensor_parallel_size 2: {message}"):
        check_tensor_parallel(tiny_config(**overrides), 2)


@pytest.mark.parametrize("options, message", [
    (dict(enable_lora=True), "enable_lora: LoRA adapters are not split"),
    (dict(kv_offload_size=0.01), "kv_transfer_config: a KV connector"),
    (dict(quantization="gguf"), "quantization: gguf keeps weights quantized"),
])
def test_options_it_does_not_combine_with_are_refused(folders, options, message):
    with pytest.raises(ValueError, match=message):
        make_llm(folders["mha"], 2, **options)


def test_ray_workers_are_refused():
    """(cadence serve and LLM refuse ray with tensor parallelism before building an engine.)"""
    options = EngineOptions.from_kwargs(tensor_parallel_size=2, distributed_executor_backend="ray")
    with pytest.raises(ValueError, match="distributed_executor_backend: ray places data-parallel"):
        check_tensor_parallel_options(options, None, tiny_config(), torch.device("cpu"))


@pytest.mark.parametrize("options, message", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size: must be >= 1"),
    (dict(distributed_executor_backend="mpi"), "distributed_executor_backend: must be one of mp, ray"),
])
def test_invalid_parallel_options_are_refused(folders, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(folders["mha"], **options)
