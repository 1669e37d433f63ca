"""Batch invariance (``batch_invariant``, ``cadence.runner.batch_invariance``).

With the mode on, a target request's greedy tokens, and their logprobs to the
bit, are the same alone and beside 1..64 random other requests (random
prompts, lengths, token counts and adapters), with and without LoRA, in
float32 and bfloat16, on the default model (weights in GGUF blocks on the C
kernel) and on tiny random dense models. Batch sizes are a fixed, seeded
sample of 1..64 (64 always in), so a run is bounded and repeatable.
Without the mode, the default model's one-row decodes take the quantized
kernel's integer path and batches its tiled path: the logprobs differ. With
it, every product on GGUF blocks takes the integer path, at any number of rows.
"""

from __future__ import annotations

import random

import pytest

from cadence import cpu_features
from cadence.core.request import LoRARequest
from cadence.engine.llm import LLM
from cadence.kernels.paged_attention import paged_attention
from cadence.models.default_model import default_model_path
from cadence.models.gguf_loader import gguf_model_config, read_gguf
from cadence.models.testing import random_model, tiny_config, write_hf_folder, write_random_adapter
from cadence.sampling_params import SamplingParams

# The mode attends on the C kernel: without a compiler it is refused (and auto is off).
pytestmark = pytest.mark.skipif(paged_attention() is None, reason="no C compiler: no batch-invariant path")
TARGET_TOKENS = 8
TARGET = SamplingParams(temperature=0.0, max_tokens=TARGET_TOKENS, ignore_eos=True, logprobs=1)
NATIVE_BF16 = cpu_features.detect().native_bf16


def batch_sizes(seed: int, count: int) -> list[int]:
    """``count`` sizes of 1..64, 64 included, drawn with ``seed``."""
    return sorted({64, *random.Random(seed).sample(range(1, 64), count - 1)})


def completion(output):
    """What must not depend on the batch: the tokens and their logprobs."""
    choice = output.outputs[0]
    return choice.token_ids, [{t: p.logprob for t, p in step.items()} for step in choice.logprobs]


def assert_invariant(llm, target, target_lora, sizes, vocab_size, adapters, seed):
    """The target's completion alone equals it in a batch of n random others, for n in ``sizes``."""
    rnd = random.Random(seed)
    alone = completion(llm.generate([target], TARGET, lora_request=target_lora, use_tqdm=False)[0])
    for n in sizes:
        prompts = [{"prompt_token_ids": [rnd.randrange(3, vocab_size) for _ in range(rnd.randint(1, 40))]}
                   for _ in range(n)]
        params = [SamplingParams(temperature=0.0, max_tokens=rnd.randint(1, 2 * TARGET_TOKENS),
                                 ignore_eos=True) for _ in range(n)]
        loras = [rnd.choice([None, *adapters]) for _ in range(n)]
        at = rnd.randrange(n + 1)
        outputs = llm.generate(prompts[:at] + [target] + prompts[at:], params[:at] + [TARGET] + params[at:],
                               lora_request=loras[:at] + [target_lora] + loras[at:], use_tqdm=False)
        assert completion(outputs[at]) == alone, f"batch of {n} others, target at {at}"


def random_prompt(vocab_size: int, seed: int, length: int = 24) -> dict:
    rnd = random.Random(seed)
    return {"prompt_token_ids": [rnd.randrange(3, vocab_size) for _ in range(length)]}


# ------------------------------------------------------------ the default model


@pytest.fixture(scope="module")
def default_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    config = gguf_model_config(*read_gguf(default_model_path()))
    adapters = []
    for i, rank in ((1, 8), (2, 16)):
        write_random_adapter(str(root / f"a{i}"), config, rank=rank, alpha=2 * rank, seed=i, std=0.05)
        adapters.append(LoRARequest(f"a{i}", i, str(root / f"a{i}")))
    return adapters


def default_llm(dtype: str, mode: str, lora: bool) -> LLM:
    options = dict(enable_lora=True, max_loras=2, max_lora_rank=16) if lora else {}
    return LLM(dtype=dtype, batch_invariant=mode, max_num_seqs=80, kv_cache_memory="256MiB",
               max_model_len=256, max_num_batched_tokens=1024, **options)


def test_default_model_float32_with_and_without_lora(default_adapters):
    llm = default_llm("float32", "on", lora=True)
    assert llm.engine.core.runner.batch_invariance.enabled
    vocab_size = llm.engine.model_config.vocab_size
    for target_lora, seed in ((None, 1), (default_adapters[0], 2)):
        assert_invariant(llm, random_prompt(vocab_size, seed), target_lora, batch_sizes(seed, 2),
                         vocab_size, default_adapters, seed)


def test_default_model_bfloat16():
    """Every product on the quantized C kernel (float32 inside): on any CPU, bfloat16 native or not."""
    llm = default_llm("bfloat16", "on", lora=False)
    vocab_size = llm.engine.model_config.vocab_size
    assert_invariant(llm, random_prompt(vocab_size, 3), None, batch_sizes(3, 2), vocab_size, [], 3)


def test_the_mode_is_what_makes_the_default_model_invariant():
    """Off, a one-row decode takes the quantized kernel's integer path (AVX2 and AVX-512
    builds: up to 16 or 12 rows), a larger batch its tiled path: other float sums, other
    logprobs. On, both take the integer path (``QuantMatmul.rows_apart``), unpadded."""
    from cadence.kernels.quant_matmul import quant_matmul

    kernel = quant_matmul()
    if kernel is None or not kernel.isa.startswith("AVX2 FMA"):
        pytest.skip("the quantized kernel has one path only here")
    others = [random_prompt(49000, seed) for seed in range(10, 10 + kernel.direct_max_rows)]
    target = random_prompt(49000, 4)
    for mode, expect_equal in (("off", False), ("on", True)):
        llm = default_llm("float32", mode, lora=False)
        invariance = llm.engine.core.runner.batch_invariance
        assert invariance.quant_rows_apart is expect_equal and invariance.min_rows == 1
        alone = completion(llm.generate([target], TARGET, use_tqdm=False)[0])
        batched = completion(llm.generate([target, *others], TARGET, use_tqdm=False)[0])
        assert (batched == alone) is expect_equal, mode


# ------------------------------------------------------------ tiny random dense models


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """An HF folder of a tiny random Llama (float weights: dense products), and two adapters."""
    root = tmp_path_factory.mktemp("tiny")
    config = tiny_config(num_hidden_layers=3, hidden_size=128, intermediate_size=320)
    write_hf_folder(str(root / "model"), random_model(config, seed=5))
    adapters = []
    for i in (1, 2):
        write_random_adapter(str(root / f"a{i}"), config, rank=4 * i, alpha=8 * i, seed=i, std=0.1)
        adapters.append(LoRARequest(f"a{i}", i, str(root / f"a{i}")))
    return str(root / "model"), adapters


@pytest.mark.parametrize("dtype", [
    "float32",
    pytest.param("bfloat16", marks=pytest.mark.skipif(
        not NATIVE_BF16, reason="bfloat16 computed in software: the mode refuses it "
                           "(tests/runner/test_batch_invariance_rules.py)")),
])
def test_tiny_dense_model_with_and_without_lora(tiny, dtype):
    folder, adapters = tiny
    llm = LLM(folder, dtype=dtype, batch_invariant="on", enable_lora=True, max_loras=2, max_lora_rank=8,
              max_num_seqs=80, num_gpu_blocks=600, max_model_len=128, max_num_batched_tokens=512)
    for target_lora, seed in ((None, 11), (adapters[1], 12)):
        assert_invariant(llm, random_prompt(256, seed), target_lora, batch_sizes(seed, 6), 256, adapters, seed)


def test_tiny_dense_model_auto_is_on(tiny):
    llm = LLM(tiny[0], dtype="float32", num_gpu_blocks=64, max_model_len=128)
    invariance = llm.engine.core.runner.batch_invariance
    assert invariance.enabled and invariance.reason.startswith("auto")


def test_invalid_value_is_named():
    with pytest.raises(ValueError, match=r"^batch_invariant: must be one of auto, on, off, got 'yes'"):
        LLM(batch_invariant="yes")

