"""KV cache groups on a real runner (a tiny random Gemma-3-shaped model): each
group's layers read its own block table, window groups free the blocks
behind their window, and the greedy tokens equal one full group's on prompts
longer than the window (chunked prefill, prefix hits, several requests at
once), through the one-call decoder, the C attention kernel layer by layer
and PyTorch's gather path alike."""

from __future__ import annotations

import io
import random

import pytest
from cadence.config import EngineOptions
from cadence.core.kv_cache import HybridKVCacheManager, KVCacheManager
from cadence.core.request import Request
from cadence.engine.builder import assemble_engine
from cadence.sampling_params import SamplingParams
from tests.runner.test_fused_decoder import CONFIG, quantized_model

WINDOW = 12
# 4 layers, the last global: 4 groups of one layer (full [3]; window [0], [1], [2]).
GEMMA3 = dict(architecture="gemma3_text", norm_placement="sandwich", norm_weight_offset=1.0,
              mlp_activation="gelu_tanh", embedding_multiplier=16.0, query_pre_attn_scalar=48.0,
              qk_norm="per_head", sliding_rope_theta=10000.0, rope_theta=1e6, full_attention_layers=(3,),
              sliding_window=WINDOW, tie_word_embeddings=True, num_hidden_layers=4)


@pytest.fixture(scope="module")
def model():
    """Projections in random GGUF blocks, as the one-call decoder takes them."""
    return quantized_model(CONFIG.replace(**GEMMA3), seed=1)


def build(model, groups: bool, path: str, **extra):
    options = EngineOptions.from_kwargs(
        device="cpu", dtype="float32", kv_cache_dtype="float32", kv_cache_memory="4MiB",
        block_size=4, max_model_len=256, max_num_batched_tokens=24, max_num_seqs=4, kv_cache_groups=groups,
        **extra)
    log = io.StringIO()
    engine = assemble_engine(options, model, model.config, None, log=log)
    runner = engine.core.runner
    if path != "one-call":
        runner.fused_decoder = None  # layer by layer
    if path == "pytorch":
        runner.attention_kernel = None  # the gather path (padded batches, SDPA)
    return engine, log.getvalue()


def prompts():
    rng = random.Random(0)
    shared = [rng.randrange(3, 250) for _ in range(40)]
    prompts = {f"r{i}": shared + [rng.randrange(3, 250) for _ in range(n)] for i, n in enumerate((30, 5, 57, 1))}
    prompts["r4"] = shared[:10] * 5  # repeats: the n-gram drafter proposes from them
    return prompts


def run(engine, rounds=2):
    """Every prompt at once, twice (the second round hits the prefix cache)."""
    core, kv = engine.core, engine.core.scheduler.kv_cache_manager
    tokens, peak = {}, 0
    for round_ in range(rounds):
        for req_id, prompt in prompts().items():
            params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
            core.add_request(Request(f"{req_id}.{round_}", prompt, params))
        while core.has_work():
            for outputs in core.step().values():
                for out in outputs.outputs:
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            kv.check_consistency()
            if isinstance(kv, HybridKVCacheManager):
                peak = max(peak, max(kv.num_owned_blocks[1:]))
    assert kv.usage == 0.0 and not kv.req_to_blocks
    return tokens, peak


@pytest.mark.parametrize("path", ["one-call", "c-kernel", "pytorch"])
def test_groups_give_one_full_groups_greedy_tokens(model, path):
    grouped, log = build(model, True, path)
    assert "4 KV cache groups of 1 layers" in log
    assert isinstance(grouped.core.scheduler.kv_cache_manager, HybridKVCacheManager)
    plain, _ = build(model, False, path)
    assert type(plain.core.scheduler.kv_cache_manager) is KVCacheManager
    calls = [0]
    if path == "one-call":
        decoder = grouped.core.runner.fused_decoder
        assert decoder is not None
        forward = decoder.forward
        decoder.forward = lambda *args: calls.__setitem__(0, calls[0] + 1) or forward(*args)
    got, peak = run(grouped)
    expected, _ = run(plain)
    assert got == expected
    assert path != "one-call" or calls[0] > 10  # decode steps in one C call, groups and all
    # A window group never held more than its window and one step's chunk per request
    # (10 blocks of 4 tokens), for all requests together, where the full group holds
    # up to 28 blocks for one request of 97 prompt tokens and 12 outputs.
    per_request = -(-(WINDOW - 1 + 24) // 4) + 1
    assert peak <= len(prompts()) * per_request


def test_a_window_groups_freed_blocks_are_reused_by_others_and_tokens_hold(model):
    """A cache that fits the prompts only because window blocks are freed:
    one full group could not even hold them (and refuses the length)."""
    options = dict(device="cpu", dtype="float32", kv_cache_dtype="float32", block_size=4, max_model_len=256,
                   max_num_batched_tokens=24, max_num_seqs=4)
    grouped = assemble_engine(EngineOptions.from_kwargs(num_gpu_blocks=60, kv_cache_groups=True, **options),
                              model, model.config, None, log=io.StringIO())
    plain = assemble_engine(EngineOptions.from_kwargs(num_gpu_blocks=200, kv_cache_groups=False, **options),
                            model, model.config, None, log=io.StringIO())
    got, _ = run(grouped, rounds=1)
    expected, _ = run(plain, rounds=1)
    assert got == expected


def test_speculative_verification_rows_read_each_groups_table(model):
    """n-gram drafts verified on the one-call decoder and layer by layer, groups and one group alike."""
    got, _ = run(build(model, True, "one-call", num_speculative_tokens=3)[0])
    expected, _ = run(build(model, False, "one-call", num_speculative_tokens=3)[0])
    assert got == expected


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_host_tier_and_swap_move_each_groups_blocks(model, mode):
    """A cache that holds the longest request alone (60 blocks: its full group
    needs 28, each window group 10): requests are preempted (swapped out and back,
    or recomputed), and the tier brings back prefixes the cache dropped; the tokens
    equal one full group's without a tier. Preemption changes which rows share a
    step (a prompt's chunk of 24 rows may become two), so both engines run
    batch-invariant: a row's products are then the same in any step, and only
    the KV cache can make the tokens differ."""
    options = dict(device="cpu", dtype="float32", kv_cache_dtype="float32", block_size=4, max_model_len=256,
                   max_num_batched_tokens=24, max_num_seqs=4, batch_invariant="on")
    log = io.StringIO()
    grouped = assemble_engine(
        EngineOptions.from_kwargs(num_gpu_blocks=60, kv_cache_groups=True, kv_offload_size=0.001,
                                  preemption_mode=mode, **options),
        model, model.config, None, log=log)
    assert "4 KV cache groups of 1 layers" in log.getvalue()
    plain = assemble_engine(EngineOptions.from_kwargs(num_gpu_blocks=200, kv_cache_groups=False, **options),
                            model, model.config, None, log=io.StringIO())
    got, _ = run(grouped)
    expected, _ = run(plain)
    assert got == expected
    scheduler = grouped.core.scheduler
    assert scheduler.num_preemptions_total > 0
    worker = grouped.core.runner.kv_connector
    assert worker.num_blocks_loaded > 0 and worker.num_load_errors == 0
    if mode == "swap":
        assert scheduler.num_swapped_preemptions_total > 0
    tier = scheduler.get_kv_connector().tier
    tier.check_consistency()
    assert tier.pins == {}
