"""The OffloadingConnector end to end on a tiny model: tier hits after the
primary prefix cache lost a prefix, swap preemption with greedy parity,
failed loads recomputed, no block or slot leaked."""

from __future__ import annotations

import pytest
import torch

from cadence.config import EngineOptions
from cadence.core.request import Request
from cadence.sampling_params import SamplingParams
# model and one_thread are the plumbing tests' fixtures (a tiny model, one torch thread).
from tests.runner.test_kv_connector_plumbing import build, model, one_thread, prompt_of  # noqa: F401

TIER_GIB = 0.001  # 1 MiB: hundreds of the tiny model's blocks; the primary pool has 14 to 24


def generate(engine, prompts, max_tokens=6, stats=None):
    """Greedy outputs by request id; ``stats`` collects the steps' scheduler stats."""
    core = engine.core
    for req_id, prompt in prompts.items():
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        core.add_request(Request(req_id, prompt, params))
    tokens = {req_id: [] for req_id in prompts}
    for _ in range(1000):
        if not core.has_work():
            break
        for outputs in core.step().values():
            if stats is not None and outputs.scheduler_stats is not None:
                stats.append(outputs.scheduler_stats)
            for output in outputs.outputs:
                tokens[output.request_id].extend(output.new_token_ids)
    assert not core.has_work()
    return tokens


def assert_nothing_leaked(engine, num_blocks):
    scheduler = engine.core.scheduler
    kv = scheduler.kv_cache_manager
    kv.check_consistency()
    assert kv.num_free_blocks == num_blocks and scheduler.requests == {}
    tier = scheduler.get_kv_connector().tier
    tier.check_consistency()
    assert tier.pins == {}


SHARED = prompt_of(0, 24)
PREFIXED = {f"r{i}": SHARED + prompt_of(i + 10, 6) for i in range(3)}


def one_by_one_with_floods(engine, stats=None):
    """Each prompt alone, then a long unrelated prompt that evicts the
    shared prefix from the 16-block primary cache (its 62 tokens take all 16)."""
    tokens = {}
    for i, (req_id, prompt) in enumerate(PREFIXED.items()):
        tokens.update(generate(engine, {req_id: prompt}, stats=stats))
        generate(engine, {f"flood{i}": prompt_of(100 + i, 61)}, max_tokens=1, stats=stats)
    return tokens


@pytest.fixture(scope="module")
def prefixed_expected(model):
    return one_by_one_with_floods(build(model, num_gpu_blocks=16))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_prefix_the_primary_cache_lost_is_loaded_from_the_tier(model, prefixed_expected, async_scheduling):
    expected = prefixed_expected
    engine = build(model, num_gpu_blocks=16, kv_offload_size=TIER_GIB,
                   async_scheduling=async_scheduling)
    stats = []
    assert one_by_one_with_floods(engine, stats) == expected
    worker = engine.core.runner.kv_connector
    # r1 and r2 each find the shared prefix's 6 blocks in the tier, not in the primary cache.
    assert worker.num_blocks_loaded == 12
    assert sum(s.prefix_cache_stats.hits for s in stats) == 0
    external = [s.connector_prefix_cache_stats for s in stats]
    assert sum(e.hits for e in external) == 2 * 24
    assert sum(e.queries for e in external) >= sum(len(p) for p in PREFIXED.values())
    assert_nothing_leaked(engine, 16)


def test_without_the_tier_the_same_workload_recomputes(model):
    engine = build(model, num_gpu_blocks=16)
    stats = []
    one_by_one_with_floods(engine, stats)
    assert sum(s.prefix_cache_stats.hits for s in stats) == 0
    assert all(s.connector_prefix_cache_stats is None for s in stats)


def test_the_tier_evicts_its_least_recently_used_blocks(model, prefixed_expected):
    # A tier of 12 slots: the floods' 14 full blocks push the shared prefix out.
    engine = build(model, num_gpu_blocks=16, kv_offload_size=12 * bytes_per_block(model) / 2**30)
    tier = engine.core.scheduler.get_kv_connector().tier
    assert tier.num_slots == 12
    assert one_by_one_with_floods(engine) == prefixed_expected
    assert engine.core.runner.kv_connector.num_blocks_loaded == 0
    assert tier.num_cached == 12
    assert_nothing_leaked(engine, 16)


def bytes_per_block(model, block_size=4):
    """A block's bytes in the cache ``build`` makes (kv_cache_dtype auto: float16 under a
    float32 model on the CPU)."""
    from cadence.runner.kv_cache import bytes_per_block as per_block, resolve_kv_cache_dtype
    import torch

    return per_block(model.config, block_size, resolve_kv_cache_dtype("auto", model.dtype, torch.device("cpu")))


# ---------------------------------------------------------------- swap preemption

CROWD = {f"r{i}": prompt_of(i, 9 + 2 * i) for i in range(4)}
CROWD_POOL = 10


def crowded(model, **options):
    """10 blocks (40 tokens) for four requests of up to 25 tokens: preemptions."""
    return build(model, num_gpu_blocks=CROWD_POOL, max_num_batched_tokens=32, **options)


@pytest.fixture(scope="module")
def crowd_expected(model):
    return generate(build(model), CROWD, max_tokens=10)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_swap_and_recompute_preemption_give_the_same_greedy_tokens(
        model, crowd_expected, mode, async_scheduling):
    engine = crowded(model, kv_offload_size=TIER_GIB, preemption_mode=mode,
                     async_scheduling=async_scheduling)
    stats = []
    assert generate(engine, CROWD, max_tokens=10, stats=stats) == crowd_expected
    scheduler = engine.core.scheduler
    assert scheduler.num_preemptions_total > 0
    swapped = scheduler.num_swapped_preemptions_total
    assert swapped == scheduler.get_kv_connector().num_swapped_out
    assert sum(s.num_swapped_preemptions for s in stats) == swapped
    if mode == "swap":
        assert swapped == scheduler.num_preemptions_total
    elif mode == "recompute":
        assert swapped == 0
    assert_nothing_leaked(engine, CROWD_POOL)


def test_a_float16_cache_swaps_its_own_bytes(model):
    """The tier takes the cache's dtype: a swapped float16 request comes back
    bit for bit, so its tokens equal an uncrowded float16 engine's."""
    expected = generate(build(model, kv_cache_dtype="float16"), CROWD, max_tokens=10)
    engine = crowded(model, kv_offload_size=TIER_GIB, preemption_mode="swap", kv_cache_dtype="float16")
    assert generate(engine, CROWD, max_tokens=10) == expected
    scheduler = engine.core.scheduler
    assert scheduler.num_swapped_preemptions_total > 0
    assert scheduler.get_kv_connector().tier is not None
    assert engine.core.runner.kv_connector.tier.dtype == torch.float16
    assert_nothing_leaked(engine, CROWD_POOL)


@pytest.mark.parametrize("policy", ["priority", "fair"])
def test_swapped_requests_come_back_under_any_queue_order(model, crowd_expected, policy):
    # A swapped request waits holding its blocks once loaded: it must run
    # before a request the queue puts first but that waits for blocks.
    engine = crowded(model, kv_offload_size=TIER_GIB, preemption_mode="swap", policy=policy)
    assert generate(engine, CROWD, max_tokens=10) == crowd_expected
    assert engine.core.scheduler.num_swapped_preemptions_total > 0
    assert_nothing_leaked(engine, CROWD_POOL)


def test_with_prefix_caching_off_the_tier_serves_no_prefix(model, prefixed_expected):
    """Prefix caching off means no request reuses another's KV: the tier saves
    nothing and finds nothing for the prompts that share a prefix (it serves
    swaps only, below)."""
    engine = build(model, num_gpu_blocks=16, kv_offload_size=TIER_GIB, enable_prefix_caching=False)
    assert one_by_one_with_floods(engine) == prefixed_expected
    worker = engine.core.runner.kv_connector
    assert worker.num_blocks_saved == 0 and worker.num_blocks_loaded == 0
    assert engine.core.scheduler.get_kv_connector().num_hit_tokens == 0
    assert_nothing_leaked(engine, 16)


def test_swap_with_prefix_caching_off_copies_partial_blocks(model, crowd_expected):
    engine = crowded(model, kv_offload_size=TIER_GIB, preemption_mode="swap",
                     enable_prefix_caching=False)
    assert generate(engine, CROWD, max_tokens=10) == crowd_expected
    connector = engine.core.scheduler.get_kv_connector()
    assert connector.num_swapped_out > 0 and connector.num_swapped_blocks > 0
    assert_nothing_leaked(engine, CROWD_POOL)


# ---------------------------------------------------------------- failures


def test_a_tier_load_that_fails_is_recomputed_and_the_slots_dropped(model, prefixed_expected):
    healthy = build(model, num_gpu_blocks=16, kv_offload_size=TIER_GIB)
    one_by_one_with_floods(healthy)
    engine = build(model, num_gpu_blocks=16, kv_offload_size=TIER_GIB)
    worker = engine.core.runner.kv_connector
    corrupt_loads(worker, lambda: 0)  # every slot a load reads lost its write
    assert one_by_one_with_floods(engine) == prefixed_expected
    assert worker.num_blocks_loaded == 0 and worker.num_load_errors == 12
    # The failed slots were dropped: r1 and r2 saved the prefix's 6 blocks again.
    assert worker.num_blocks_saved == healthy.core.runner.kv_connector.num_blocks_saved + 12
    assert_nothing_leaked(engine, 16)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_swap_in_that_fails_is_recomputed(model, crowd_expected, async_scheduling):
    engine = crowded(model, kv_offload_size=TIER_GIB, preemption_mode="swap",
                     enable_prefix_caching=False, async_scheduling=async_scheduling)
    worker = engine.core.runner.kv_connector
    failures = iter(range(3))
    corrupt_loads(worker, lambda: next(failures, None))  # the first three loads fail
    assert generate(engine, CROWD, max_tokens=10) == crowd_expected
    assert worker.num_load_errors > 0
    assert_nothing_leaked(engine, CROWD_POOL)


def corrupt_loads(worker, should_fail):
    """Before each step's loads, erase the tags of the slots they read while
    ``should_fail()`` is not None (as if their copies were lost)."""
    start = worker.start_load_kv

    def start_load_kv(metadata):
        if metadata is not None and metadata.loads and should_fail() is not None:
            for orders in metadata.loads.values():
                for _, slot, _ in orders:
                    worker.slot_tags[slot] = 0
        start(metadata)

    worker.start_load_kv = start_load_kv


# ---------------------------------------------------------------- options


@pytest.mark.parametrize("options, message", [
    ({"preemption_mode": "swap"}, r"^preemption_mode: swap needs the host-memory tier"),
    ({"preemption_mode": "auto"}, r"^preemption_mode: auto needs the host-memory tier"),
    ({"preemption_mode": "swapp"}, r"^preemption_mode: must be one of recompute, swap, auto"),
])
def test_bad_preemption_options_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        EngineOptions.from_kwargs(**options)


def test_preemption_mode_defaults_to_auto_with_a_tier():
    assert EngineOptions.from_kwargs().preemption_mode == "recompute"
    assert EngineOptions.from_kwargs(kv_offload_size=1.0).preemption_mode == "auto"
    assert EngineOptions.from_kwargs(kv_offload_size=1.0,
                                     preemption_mode="recompute").preemption_mode == "recompute"


def test_a_tier_larger_than_the_machine_is_refused(model):
    with pytest.raises(ValueError, match=r"^kv_offload_size: the tier needs .* GiB, more than"):
        build(model, kv_offload_size=1e6)


@pytest.mark.parametrize("options, message", [
    ({"kv_connector": "OffloadingConnector"}, r"^kv_offload_size: the OffloadingConnector needs a tier size"),
    ({"kv_offload_size": 0.01, "kv_role": "kv_producer"}, r"^kv_role: the OffloadingConnector .* not kv_producer"),
    ({"kv_offload_size": 0.01, "kv_connector_extra_config": {"x": 1}},
     r"^kv_connector_extra_config: the OffloadingConnector takes no options \(got 'x'\)"),
])
def test_offloading_options_it_cannot_honour_are_refused(model, options, message):
    with pytest.raises(ValueError, match=message):
        build(model, **options)
