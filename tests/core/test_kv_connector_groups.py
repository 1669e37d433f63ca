"""KV connectors with KV cache groups: the host tier keys a slot by block hash
and group, a tier hit or a swap coming back loads into a window group only
what its window reads, swap-outs skip the null entries behind a window, and
P/D sends one block list per group and pulls a window group's window only.
Every read is checked by the shadow KV cache (``tests/core/kv_oracle.py``);
the random workloads of ``test_kv_oracle.py`` mix groups with all of it."""

from __future__ import annotations

from cadence.config import KVTransferConfig
from cadence.core.kv_cache import plan_kv_cache_layout
from cadence.core.kv_transfer.offloading import OffloadingConnector
from cadence.core.kv_transfer.pd_connector import CONSUMER, PRODUCER, PDConnectorScheduler
from cadence.core.sched.kv_connector import KVConnectorContext
from cadence.core.testing import flatten, greedy_stream, new_request, new_scheduler, prompt_of
from tests.core.kv_oracle import BLOCK_SIZE, BYTES_PER_BLOCK, OracleRunner, PDWorkers

WINDOW = 9  # a query at position p reads keys from p - 8 on: two blocks of 4 before it
LAYOUT = plan_kv_cache_layout(2, WINDOW, (1,))  # full [1]; window [0]


def tier_engine(num_blocks: int = 64, mode: str = "recompute", budget: int = 64, tier_slots: int = 64,
                caching: bool = True):
    context = KVConnectorContext(
        block_size=BLOCK_SIZE, num_blocks=num_blocks, bytes_per_block=BYTES_PER_BLOCK,
        seconds_per_token=1e-3, copy_bytes_per_second=1e10, preemption_mode=mode)
    connector = OffloadingConnector(
        KVTransferConfig(kv_offload_size=tier_slots * BYTES_PER_BLOCK / 2**30), context)
    scheduler = new_scheduler(block_size=BLOCK_SIZE, num_gpu_blocks=num_blocks, kv_connector=connector,
                              kv_cache_layout=LAYOUT, max_num_batched_tokens=budget,
                              enable_prefix_caching=caching)
    return scheduler, OracleRunner(sliding_windows=LAYOUT.sliding_windows)


def drive(scheduler, runner, requests, streams):
    """Run ``requests`` to the end; each step's connector metadata."""
    for request in requests:
        scheduler.add_request(request)
    metas = []
    for _ in range(500):
        if not scheduler.has_requests():
            return metas
        so = scheduler.schedule()
        metas.append(so.kv_connector_metadata)
        for out in flatten(scheduler.update_from_output(so, runner.execute(so))):
            streams.setdefault(out.request_id, []).extend(out.new_token_ids)
        scheduler.kv_cache_manager.check_consistency()
    raise AssertionError("requests left")


def assert_all_free(scheduler):
    kv = scheduler.kv_cache_manager
    assert not kv.req_to_blocks and kv.num_free_blocks == kv.block_pool.num_blocks - 1
    tier = scheduler.connector.tier
    tier.check_consistency()
    assert tier.pins == {}


def test_a_tier_hit_loads_every_full_position_and_a_window_groups_window():
    scheduler, runner = tier_engine()
    prompt = prompt_of("a", 40)  # 10 full blocks, each saved in both groups as it is computed
    streams = {}
    drive(scheduler, runner, [new_request("a", prompt, max_tokens=3, ignore_eos=True)], streams)
    assert scheduler.kv_cache_manager.reset_prefix_cache()  # only the tier holds the prefix now
    longer = prompt + prompt_of("b", 5)
    metas = drive(scheduler, runner, [new_request("b", longer, max_tokens=4, ignore_eos=True)], streams)
    loads = [orders for meta in metas for req_id, orders in meta.loads.items() if req_id == "b"]
    # Full group: positions 0-9; window group: what a query at 40 reads, positions 8 and 9.
    assert [len(orders) for orders in loads] == [10 + 2]
    assert all(block_id != 0 for block_id, _, _ in loads[0])  # never the null block
    assert streams["b"] == greedy_stream(longer, 4)  # every read checked by the shadow cache
    assert runner.shadow_kv.num_reads_checked > 0
    assert_all_free(scheduler)


def test_a_load_takes_no_block_a_window_group_would_not_read():
    """20 blocks (19 usable): a 40-token tier hit would need 10 blocks in each
    group if the window group took one for every loaded position; it takes the
    2 its window reads at the load's end, so the request is admitted at all."""
    scheduler, runner = tier_engine(num_blocks=20, budget=8)
    prompt = prompt_of("a", 40)
    streams = {}
    drive(scheduler, runner, [new_request("a", prompt, max_tokens=3, ignore_eos=True)], streams)
    kv = scheduler.kv_cache_manager
    assert kv.reset_prefix_cache()  # only the tier holds the prefix now
    longer = prompt + prompt_of("b", 5)
    scheduler.add_request(new_request("b", longer, max_tokens=4, ignore_eos=True))
    so = scheduler.schedule()  # the load is issued; the request waits for it
    assert [len(orders) for orders in so.kv_connector_metadata.loads.values()] == [10 + 2]
    full, window = kv.req_to_blocks["b"]
    assert len(full) == len(window) == 10
    assert window[:8] == [kv.null_block] * 8 and kv.null_block not in window[8:] + full
    assert kv.num_owned_blocks == [10, 2]
    for out in flatten(scheduler.update_from_output(so, runner.execute(so))):
        streams.setdefault(out.request_id, []).extend(out.new_token_ids)
    drive(scheduler, runner, [], streams)
    assert streams["b"] == greedy_stream(longer, 4)  # every read checked by the shadow cache
    assert_all_free(scheduler)


def test_swap_preemption_copies_each_groups_blocks_and_none_behind_a_window():
    # Two requests that outgrow 30 blocks together: one is swapped out and back
    # (prefix caching off: the tier holds swapped KV only, so every block is copied).
    scheduler, runner = tier_engine(num_blocks=30, mode="swap", budget=16, caching=False)
    prompts = {f"r{i}": prompt_of(f"r{i}", 20) for i in range(2)}
    streams = {}
    metas = drive(scheduler, runner, [new_request(req_id, prompt, max_tokens=30, ignore_eos=True)
                                      for req_id, prompt in prompts.items()], streams)
    assert scheduler.num_swapped_preemptions_total >= 1
    swap_outs = [order for meta in metas for order in meta.swap_outs]
    assert swap_outs and all(block_id != 0 for block_id, _, _ in swap_outs)
    # A swapped request's window group came back with its window, not its whole context.
    reloads = [orders for meta in metas for orders in meta.loads.values()]
    assert reloads
    for req_id, prompt in prompts.items():
        assert streams[req_id] == greedy_stream(prompt, 30)
    assert_all_free(scheduler)


def pd_engines(consumer_layout=LAYOUT, budget: int = 16):
    def engine(role, layout):
        context = KVConnectorContext(block_size=BLOCK_SIZE, num_blocks=64,
                                     bytes_per_block=BYTES_PER_BLOCK, kv_role=role)
        connector = PDConnectorScheduler(KVTransferConfig(kv_connector="PDConnector", kv_role=role), context)
        num_blocks = 64 if layout is None else 129
        return new_scheduler(block_size=BLOCK_SIZE, num_gpu_blocks=num_blocks, kv_connector=connector,
                             kv_cache_layout=layout, max_num_batched_tokens=budget)
    windows = None if consumer_layout is None else consumer_layout.sliding_windows
    producer, consumer = engine(PRODUCER, LAYOUT), engine(CONSUMER, consumer_layout)
    p_runner = OracleRunner(sliding_windows=LAYOUT.sliding_windows)
    c_runner = OracleRunner(sliding_windows=windows)
    loads = []
    PDWorkers(p_runner, c_runner, lambda req_id: False)  # sets the runners' hooks
    consumer_step = c_runner.connector_hook
    c_runner.connector_hook = lambda meta: loads.extend(meta.loads) or consumer_step(meta)
    return (producer, p_runner), (consumer, c_runner), loads


def run_pd(prompt, max_tokens, consumer_layout=LAYOUT):
    """Prefill ``prompt`` on a producer, decode it on a consumer: (the params the
    producer sent, the consumer's loads, its stream)."""
    (producer, p_runner), (consumer, c_runner), loads = pd_engines(consumer_layout)
    first = new_request("a", prompt, max_tokens=1, ignore_eos=True)
    first.kv_transfer_params = {"do_remote_decode": True}
    producer.add_request(first)
    sent, stream = [], []
    for _ in range(200):
        for scheduler, runner in ((producer, p_runner), (consumer, c_runner)):
            if not scheduler.has_requests():
                continue
            so = scheduler.schedule()
            for out in flatten(scheduler.update_from_output(so, runner.execute(so))):
                if scheduler is producer and out.kv_transfer_params is not None:
                    sent.append(out.kv_transfer_params)
                    second = new_request("a", prompt, max_tokens=max_tokens, ignore_eos=True)
                    second.kv_transfer_params = out.kv_transfer_params
                    consumer.add_request(second)
                elif scheduler is consumer:
                    stream.extend(out.new_token_ids)
            scheduler.kv_cache_manager.check_consistency()
        if not producer.has_requests() and not consumer.has_requests():
            break
    for scheduler in (producer, consumer):
        kv = scheduler.kv_cache_manager
        assert not kv.req_to_blocks and kv.num_free_blocks + kv.num_reserved_blocks == kv.block_pool.num_blocks
    return sent, loads, stream


def test_pd_sends_a_block_list_per_group_and_pulls_a_window_groups_window_only():
    prompt = prompt_of("a", 41)  # 11 positions; prefilled in chunks of 16, 16 and 9
    sent, loads, stream = run_pd(prompt, 5)
    (params,) = sent
    full, window = params["remote_block_ids"]
    assert len(full) == len(window) == 11
    # The producer's last chunk (from 32 on) freed the window entries 0-5 behind it.
    assert window[:6] == [0] * 6 and 0 not in window[6:] and 0 not in full
    (load,) = [load for load in loads if load.local_block_ids]
    # Full group: all 11 positions; window group: what a query at 40 reads, positions 8-10.
    assert load.remote_block_ids == full + window[8:]
    assert stream == greedy_stream(prompt, 5)


def test_a_consumer_that_groups_its_layers_otherwise_computes_the_prompt_itself():
    prompt = prompt_of("a", 41)
    sent, loads, stream = run_pd(prompt, 5, consumer_layout=None)
    assert len(sent) == 1 and not any(load.local_block_ids for load in loads)
    assert stream == greedy_stream(prompt, 5)
