"""``kv_cache_dtype``: a float16, bfloat16 or q8_0 KV cache under a float32 model on
the CPU (twice, or 1.88x twice, the tokens in the same memory), refused where it
cannot run; ``auto`` is float16 for a float32 model on the CPU."""

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
    assert EngineOptions.from_kwargs(kv_cache_dtype="q8_0").cache.kv_cache_dtype == "q8_0"
    for bad in ("fp8", "fp8_e4m3", "int8", "half", "q4_0"):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            EngineOptions.from_kwargs(kv_cache_dtype=bad)


def test_auto_is_float16_under_float32_on_the_cpu_else_the_models_dtype_and_a_gpu_keeps_it():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kv_cache_dtype("auto", torch.float32, cpu) == torch.float16
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, cpu) == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", torch.float32, cuda) == torch.float32
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
    full, _ = engine_of(model, kv_cache_memory="1MiB", kv_cache_dtype="float32")
    half, log = engine_of(model, kv_cache_memory="1MiB", kv_cache_dtype="float16")
    blocks = full.options.cache.num_gpu_blocks
    assert half.options.cache.num_gpu_blocks == 2 * blocks
    assert full.options.cache.kv_cache_dtype == "float32"
    assert half.options.cache.kv_cache_dtype == "float16"
    runner = half.core.runner
    assert runner.kv_cache.data.dtype == torch.float16
    assert runner.kv_cache.data.nbytes == full.core.runner.kv_cache.data.nbytes
    assert "(float16, cpu)" in log
    # The C kernel reads the half-width cache where it is built; else PyTorch's path does.
    assert runner.attention_kernel is None or runner.attention_kernel.supports(torch.float32, torch.float16)


def test_a_q8_0_cache_holds_1_88_times_float16s_blocks_and_says_why_auto_is_float16():
    model = random_model(tiny_config(head_dim=32), seed=0)
    half, log = engine_of(model, kv_cache_memory="1MiB")  # auto
    assert half.core.runner.kv_cache.data.dtype == torch.float16
    assert "(float16, cpu; auto: a float32 model's cache in float16" in log
    q8, log = engine_of(model, kv_cache_memory="1MiB", kv_cache_dtype="q8_0")
    assert q8.options.cache.kv_cache_dtype == "q8_0" and "(q8_0, cpu)" in log
    assert q8.options.cache.num_gpu_blocks == half.options.cache.num_gpu_blocks * 64 // 34
    tokens = generate(q8, {"a": [5, 6, 7, 8, 9, 10], "b": [11, 12, 13] * 8}, max_tokens=5)
    assert [len(t) for t in tokens.values()] == [5, 5]
    with pytest.raises(ValueError, match="head_dim 16 is not a multiple of 32"):
        engine_of(random_model(tiny_config(), seed=0), num_gpu_blocks=8, kv_cache_dtype="q8_0")


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
    return default_model_streams("float32")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
def test_greedy_tokens_of_the_default_model_match_a_float32_cache(kv_cache_dtype, float32_streams):
    """Rounding keys and values to half width (auto: float16) or to q8_0 blocks moves
    no token here (8 of 8 streams equal when measured; at most one may differ on
    another CPU)."""
    streams = default_model_streams(kv_cache_dtype)
    assert all(len(s) == 32 for s in streams)
    equal = sum(a == b for a, b in zip(float32_streams, streams))
    assert equal >= 7, f"{equal} of 8 greedy streams equal"


def default_model_perplexity(kv_cache_dtype):
    """Perplexity of the default model over two 256-token chunks of bench's fixed text
    (every prompt token's log-probability, the cache read by each chunk's attention)."""
    import math

    from cadence.engine.llm import LLM

    llm = LLM(dtype="float32", kv_cache_dtype=kv_cache_dtype, num_threads=2, kv_cache_memory="32MiB",
              enable_prefix_caching=False)
    text = (Path(__file__).resolve().parents[2] / "bench" / "data" / "perplexity.txt").read_text()
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    chunks = [ids[i * 256:(i + 1) * 256] for i in range(2)]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": c} for c in chunks], params, use_tqdm=False)
    nlls = [-o.prompt_logprobs[p][c[p]].logprob for c, o in zip(chunks, outputs) for p in range(1, len(c))]
    return math.exp(sum(nlls) / len(nlls))


def test_a_q8_0_cache_keeps_perplexity_within_half_a_percent_of_float16():
    float16, q8_0 = default_model_perplexity("float16"), default_model_perplexity("q8_0")
    assert float16 != q8_0  # the rounding did reach the attention
    assert abs(q8_0 / float16 - 1) < 0.005, (q8_0, float16)
