"""KV cache groups on the real Gemma 3 270M file (issue 34 item 2): 15 of its
18 layers attend over a 512-token window, so with groups (1 full + 5 window
groups of 3 layers) a fixed ``kv_cache_memory`` holds >= 3.5x the 8,192-token
sequences of one full group, and the greedy tokens on prompts longer than
the window are those of one full group (chunked prefill, several requests at
once, prefix hits in a second round)."""

from __future__ import annotations

import argparse
import json

import pytest

from cadence.core.kv_cache import HybridKVCacheManager, KVCacheManager
from cadence.core.testing import sequences_held
from cadence.engine.llm import LLM
from cadence.sampling_params import SamplingParams
from tests.models.gemma3_file import gemma3_path

CONTEXT = 8192
BUDGET = 256  # tokens per step: the prompts below take several chunks


@pytest.fixture(scope="module")
def engines():
    """(with groups, one full group), the same file and memory."""
    made = {}
    for groups in (True, False):
        made[groups] = LLM(model=gemma3_path(), dtype="float32", kv_cache_memory="1GiB", max_model_len=CONTEXT,
                           max_num_seqs=64, max_num_batched_tokens=BUDGET, num_threads=2,
                           kv_cache_groups=groups)
    return made


def prompts(tokenizer) -> list[list[int]]:
    """Real text longer than the window: a shared document, then a question each."""
    document = tokenizer.encode(argparse.__doc__ + "\n" + json.__doc__)
    assert len(document) > 600
    questions = ["\nIn one sentence, what does this module do?", "\nName one function it defines:",
                 "\nSummary:"]
    return [document + tokenizer.encode(q)[1:] for q in questions]


def test_greedy_tokens_with_groups_equal_one_full_groups(engines):
    grouped, plain = engines[True], engines[False]
    assert isinstance(grouped.engine.core.scheduler.kv_cache_manager, HybridKVCacheManager)
    assert type(plain.engine.core.scheduler.kv_cache_manager) is KVCacheManager
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts(grouped.tokenizer)]
    results = {}
    for groups, llm in engines.items():
        first = llm.generate(batch, params, use_tqdm=False)  # three at once, 256-token chunks
        again = llm.generate(batch[:2], params, use_tqdm=False)  # prefix hits past the window
        results[groups] = [list(o.outputs[0].token_ids) for o in first + again]
        assert again[0].num_cached_tokens > 512
    print("greedy tokens, groups and one full group:", json.dumps(results[True]))
    assert results[True] == results[False]
    stats = grouped.engine.core.scheduler.make_stats()
    assert set(stats.kv_cache_group_usage) == {"0:full", *(f"{g}:window512" for g in range(1, 6))}


def test_a_fixed_memory_holds_3_5x_the_long_sequences(engines):
    managers = {groups: llm.engine.core.scheduler.kv_cache_manager for groups, llm in engines.items()}
    # What the allocator's block counts say: blocks in the pool / blocks one sequence
    # holds at most (a window group: its window and one step's chunk).
    capacity = {groups: kv.max_concurrency(CONTEXT, BUDGET) for groups, kv in managers.items()}
    # And what it admits: sequences allocated one after another until the pool refuses.
    held = {groups: sequences_held(kv, CONTEXT, BUDGET) for groups, kv in managers.items()}
    assert all(kv.usage == 0.0 for kv in managers.values())
    print("8,192-token sequences in 1 GiB: capacity", capacity, "held at once", held)
    assert capacity[True] >= 3.5 * capacity[False], capacity
    assert held[False] == int(capacity[False]) and held[True] >= 3.5 * held[False], held


def test_the_simulator_admits_what_the_engine_admits(engines):
    """Issue 34 item 5: the simulator's roofline prices Gemma 3's window groups and the cache's
    width (float16, as the engine's auto keeps a float32 model's cache on the CPU): in the
    same 1 GiB it holds the engine's number of 8,192-token sequences, within 5%."""
    from dataclasses import replace

    from cadence.config import CacheConfig, SchedulerConfig
    from cadence.sim.cost_model import PROFILES, ModelShape, RooflineCostModel
    from cadence.sim.simulator import Simulator

    engine = engines[True].engine
    config = engine.model_config
    assert str(engine.core.runner.kv_cache.data.dtype) == "torch.float16"
    shape = ModelShape(num_params=config.num_params(), num_layers=config.num_hidden_layers,
                       num_heads=config.num_attention_heads, head_dim=config.head_dim,
                       num_kv_heads=config.num_key_value_heads, sliding_window=config.sliding_window,
                       full_attention_layers=tuple(config.full_attention_layers))
    cost_model = RooflineCostModel(replace(PROFILES["cpu"], kv_cache_bytes=2**30), shape)
    simulated = {}
    for groups in (True, False):
        simulator = Simulator(SchedulerConfig(max_model_len=CONTEXT, max_num_batched_tokens=BUDGET, max_num_seqs=64),
                              CacheConfig(kv_cache_groups=groups), cost_model)
        simulated[groups] = sequences_held(simulator.scheduler.kv_cache_manager, CONTEXT, BUDGET)
    held = {groups: sequences_held(llm.engine.core.scheduler.kv_cache_manager, CONTEXT, BUDGET)
            for groups, llm in engines.items()}
    print("8,192-token sequences in 1 GiB, simulated", simulated, "engine", held)
    for groups in (True, False):
        assert abs(simulated[groups] / held[groups] - 1) <= 0.05, (groups, simulated, held)
