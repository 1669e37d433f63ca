"""``kv_cache_dtype``: a float16 or bfloat16 KV cache under a float32 model on the
CPU (twice the tokens in the same memory), refused where it cannot run."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from cadence.config import CacheConfig, EngineOptions
from cadence.engine.builder import assemble_engine
from cadence.models.testing import random_model, tiny_config
from cadence.runner.kv_cache import resolve_kv_cache_dtype
from cadence.sampling_params import SamplingParams
from tests.runner.test_kv_connector_plumbing import generate

WORKLOAD = Path(__file__).resolve().parents[3] / "shared" / "workloads" / "cpu-throughput-v1.json"


def test_the_option_takes_the_float_names_and_refuses_others_by_name():
    assert CacheConfig().kv_cache_dtype == "auto"
    assert EngineOptions.from_kwargs(kv_cache_dtype="float16").cache.kv_cache_dtype == "float16"
    for bad in ("fp8", "fp8_e4m3", "int8", "half"):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            EngineOptions.from_kwargs(kv_cache_dtype=bad)


def test_auto_is_the_models_dtype_and_a_gpu_keeps_it():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, cpu) == torch.bfloat16
    assert resolve_kv_cache_dtype("float16", torch.float32, cpu) == torch.float16
    assert resolve_kv_cache_dtype("bfloat16", torch.bfloat16, cuda) == torch.bfloat16
    with pytest.raises(ValueError, match="kv_cache_dtype: float16 differs from the model's bfloat16"):
        resolve_kv_cache_dtype("float16", torch.bfloat16, cuda)


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(), seed=0)


def engine_of(model, **options):
    log = io.StringIO()
    engine = assemble_engine(EngineOptions.from_kwargs(device="cpu", dtype=str(model.dtype).removeprefix("torch."),
                                                       block_size=4, max_model_len=128, **options),
                             model, model.config, None, log=log)
    return engine, log.getvalue()


def test_a_half_width_cache_holds_twice_the_blocks_in_the_same_memory(model):
    full, _ = engine_of(model, kv_cache_memory="1MiB")
    half, log = engine_of(model, kv_cache_memory="1MiB", kv_cache_dtype="float16")
    blocks = full.options.cache.num_gpu_blocks
    assert half.options.cache.num_gpu_blocks == 2 * blocks
    assert full.options.cache.kv_cache_dtype == "float32"  # auto, made concrete
    assert half.options.cache.kv_cache_dtype == "float16"
    runner = half.core.runner
    assert runner.kv_cache.data.dtype == torch.float16
    assert runner.kv_cache.data.nbytes == full.core.runner.kv_cache.data.nbytes
    assert "(float16, cpu)" in log
    # The C kernel reads the half-width cache where it is built; else PyTorch's path does.
    assert runner.attention_kernel is None or runner.attention_kernel.supports(torch.float32, torch.float16)


def test_a_bfloat16_model_over_a_float16_cache_takes_pytorchs_path(model):
    bf16 = random_model(tiny_config(), dtype=torch.bfloat16, seed=0)
    engine, log = engine_of(bf16, num_gpu_blocks=32, kv_cache_dtype="float16")
    assert engine.core.runner.attention_kernel is None
    if engine.core.runner.cpu_paths.attention_kernel is not None:
        assert "attention over the cache on PyTorch's SDPA" in log
    tokens = generate(engine, {"a": [5, 6, 7, 8, 9, 10], "b": [11, 12, 13]}, max_tokens=5)
    assert [len(t) for t in tokens.values()] == [5, 5]
    engine.core.scheduler.kv_cache_manager.check_consistency()
    assert engine.core.scheduler.kv_cache_manager.num_free_blocks == 32


def default_model_streams(kv_cache_dtype):
    """The default model over 8 of cpu-throughput-v1's prompts, 32 greedy tokens each."""
    from cadence.engine.llm import LLM

    prompts = json.loads(WORKLOAD.read_text())["prompt_ids"][:8]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm = LLM(dtype="float32", kv_cache_dtype=kv_cache_dtype, num_threads=2, kv_cache_memory="32MiB")
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def float32_streams():
    return default_model_streams("auto")


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_greedy_tokens_of_the_default_model_match_a_float32_cache(kv_cache_dtype, float32_streams):
    """Rounding keys and values to half width moves no token here (8 of 8 streams
    equal when measured; at most one may differ on another CPU)."""
    streams = default_model_streams(kv_cache_dtype)
    assert all(len(s) == 32 for s in streams)
    equal = sum(a == b for a, b in zip(float32_streams, streams))
    assert equal >= 7, f"{equal} of 8 greedy streams equal"
