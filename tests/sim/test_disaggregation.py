"""Prefill/decode disaggregation in the simulator (``cadence.sim.disaggregation``):
the real PDConnector scheduler side on both pools, pulls priced on a link."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from cadence.core.sched.slo import SLOUnattainable
from cadence.sim.disaggregation import TRANSFER_LINKS, PDFleet, compare_pd
from cadence.sim.simulator import SimulationStalled
from cadence.sim.workload import RequestSpec, SyntheticWorkload
from tests.sim.sim_helpers import LinearCost, configs, specs_at

KV_BYTES_PER_TOKEN = 131072  # Llama-3-8B in bf16: 32 layers x 8 KV heads x 128 x 2 x 2 bytes


class KVCost(LinearCost):
    """The linear cost model with a model's KV bytes per token, as the roofline has."""

    kv_bytes_per_token = KV_BYTES_PER_TOKEN


def fleet(num_prefill=1, num_decode=1, link="pcie", **options) -> PDFleet:
    fleet_options = {k: options.pop(k) for k in ("routing", "transfer_latency_s") if k in options}
    scheduler, cache = configs(**{"max_num_batched_tokens": 2048, **options})
    return PDFleet(num_prefill, num_decode, link, scheduler, cache, KVCost(), **fleet_options)


def assert_all_blocks_free(pd: PDFleet) -> None:
    for replica in pd.replicas:
        scheduler = replica.core.scheduler
        scheduler.kv_cache_manager.check_consistency()
        assert scheduler.kv_cache_manager.usage == 0
        assert not scheduler.requests and not scheduler.sending_req_ids
        assert not scheduler.has_requests()


@pytest.mark.parametrize("latency", [0.0, 2e-4])
def test_an_idle_fleet_serves_a_request_in_prefill_plus_pull_plus_one_decode_step(latency):
    pd = fleet(link="ethernet-100g", transfer_latency_s=latency)
    cost = LinearCost()
    result = pd.run([RequestSpec(0.5, 1000, 6)])
    prefill_step = cost.base + cost.per_token * 1000
    pull = 1000 * KV_BYTES_PER_TOKEN / 12.5e9
    first_decode_step = cost.base + cost.per_token * 1  # the last prompt token only
    recorder = result.recorder
    assert recorder.first_token[0] - 0.5 == pytest.approx(prefill_step + pull + latency + first_decode_step,
                                                          rel=1e-12)
    assert recorder.last_token[0] - recorder.first_token[0] == pytest.approx(5 * first_decode_step, rel=1e-12)
    assert result.transfer_bytes == 1000 * KV_BYTES_PER_TOKEN
    assert result.transfer_s == pytest.approx(pull, rel=1e-12)
    summary = result.summary()
    assert summary["transfers"] == {"count": 1, "bytes": 1000 * KV_BYTES_PER_TOKEN,
                                    "seconds": pytest.approx(pull), "link_wait_s": 0.0}
    assert summary["num_finished"] == 1 and recorder.num_output == [6]


def test_a_pull_that_ends_during_a_decode_step_is_reported_when_that_step_ends():
    """Request 0 keeps the decode replica busy in steps of one token; request 1's
    pull starts with the step after it reaches the decode replica, and its first
    token comes one step after the step in which its pull ended."""
    cost = LinearCost()
    pull_s = KV_BYTES_PER_TOKEN / 32e9  # per token, on pcie
    one_token_step = cost.base + cost.per_token
    grid_start = cost.base + cost.per_token * 16 + 16 * pull_s  # request 0's last prompt token

    def next_step_start(t: float) -> float:
        return grid_start + math.ceil((t - grid_start) / one_token_step) * one_token_step

    recorder = fleet().run([RequestSpec(0.0, 16, 200), RequestSpec(0.002, 1000, 3)]).recorder
    assert recorder.first_token[0] == pytest.approx(grid_start + one_token_step, rel=1e-12)
    pull_start = next_step_start(0.002 + cost.base + cost.per_token * 1000)
    reported = next_step_start(pull_start + 1000 * pull_s)
    two_token_step = cost.base + 2 * cost.per_token  # request 1's last prompt token, request 0's next
    assert recorder.first_token[1] == pytest.approx(reported + two_token_step, rel=1e-9)


def test_the_decode_replica_computes_only_the_last_prompt_token_and_the_outputs():
    specs = SyntheticWorkload(num_requests=40, rate=50, prompt_len="uniform:100:600",
                              output_len="uniform:1:20", seed=4).generate()
    pd = fleet(2, 2)
    result = pd.run(specs)
    assert result.num_preemptions == 0
    prefilled = sum(r.simulator.runner.num_tokens_computed for r in pd.prefills)
    decoded = sum(r.simulator.runner.num_tokens_computed for r in pd.decodes)
    assert prefilled == sum(s.prompt_tokens for s in specs)
    # Per request: its last prompt token (whose logits give the first output), then
    # one step per further output token; a dropped pull would compute the prompt.
    assert decoded == sum(s.output_tokens for s in specs)
    assert result.num_transfers == 40
    assert result.transfer_bytes == sum(s.prompt_tokens for s in specs) * KV_BYTES_PER_TOKEN


def test_a_faster_link_gives_a_lower_ttft():
    ttft = {}
    for link in ("ethernet-100g", "pcie", "rdma-400g", "nvlink"):
        recorder = fleet(link=link).run(specs_at([0.0], prompt=1500, output=4)).recorder
        ttft[link] = recorder.first_token[0]
    assert ttft["ethernet-100g"] > ttft["pcie"] > ttft["rdma-400g"] > ttft["nvlink"]


@pytest.mark.parametrize("routing, async_scheduling", [
    ("round_robin", False), ("least_loaded", False), ("cache_aware", False), ("round_robin", True)])
def test_every_request_finishes_whole_and_every_block_comes_back(routing, async_scheduling):
    """Small caches: decode replicas queue and preempt, prefill replicas hold
    prompts until they are pulled; nothing is lost, nothing leaks."""
    specs = SyntheticWorkload(num_requests=80, rate=400, prompt_len="uniform:50:400",
                              output_len="uniform:1:60", prefix_groups=4, seed=2).generate()
    pd = fleet(2, 3, routing=routing, num_gpu_blocks=96, max_num_seqs=8,
               async_scheduling=async_scheduling)
    result = pd.run(specs)
    if routing == "round_robin":
        assert result.num_preemptions > 0  # the small caches do bite
    assert all(result.recorder.finished)
    assert result.recorder.num_output == [s.output_tokens for s in specs]
    assert_all_blocks_free(pd)
    assert not pd.prefill_router.routed and not pd.decode_router.routed


def test_a_request_no_decode_replica_can_hold_is_rejected_not_hung():
    pd = fleet(num_gpu_blocks=8)  # 128 tokens per replica
    specs = [RequestSpec(0.0, 100, 20), RequestSpec(0.1, 100, 40), RequestSpec(0.2, 300, 1)]
    result = pd.run(specs)
    assert result.recorder.rejected == [False, True, True]
    assert result.summary()["num_finished"] == 1
    assert_all_blocks_free(pd)


def test_a_request_the_decode_replica_refuses_frees_the_prompt_its_prefill_holds():
    pd = fleet()

    def refuse_request_1(request):
        if request.request_id == "1":
            raise SLOUnattainable("slo_ttft_s: out of reach", 1.0)

    pd.decodes[0].core.scheduler._check_admission = refuse_request_1
    result = pd.run(specs_at([0.0, 0.01, 0.02], prompt=200))
    assert result.recorder.rejected == [False, True, False]
    assert result.recorder.finished == [True, False, True]
    assert result.num_transfers == 2
    assert_all_blocks_free(pd)


def test_a_pull_that_never_comes_is_reported():
    pd = fleet()
    pd.run(specs_at([0.0]))
    pd.prefills[0].core.scheduler.sending_req_ids.add("ghost")
    with pytest.raises(SimulationStalled, match="held for a pull"):
        pd._check_all_done()


def test_bad_options_raise_naming_the_option():
    scheduler, cache = configs()
    with pytest.raises(ValueError, match="pd_link: must be one of pcie, nvlink, ethernet-100g"):
        PDFleet(1, 1, "carrier-pigeon", scheduler, cache, KVCost())
    with pytest.raises(ValueError, match="pd_link"):
        compare_pd([], 1, 1, ["pcie", "infiniband?"], scheduler, cache, KVCost())
    with pytest.raises(ValueError, match="num_decode"):
        PDFleet(1, 0, "pcie", scheduler, cache, KVCost())
    with pytest.raises(ValueError, match="transfer_latency_s"):
        PDFleet(1, 1, "pcie", scheduler, cache, KVCost(), transfer_latency_s=-1)
    with pytest.raises(ValueError, match="pd_link: .*roofline"):
        PDFleet(1, 1, "pcie", scheduler, cache, LinearCost())
    assert {"pcie", "nvlink", "ethernet-100g", "rdma-400g"} <= set(TRANSFER_LINKS)


def test_compare_pd_runs_the_same_specs_on_data_parallel_replicas_and_each_link():
    specs = SyntheticWorkload(num_requests=30, rate=100, prompt_len="uniform:100:500",
                              output_len="uniform:2:30", seed=1).generate()
    scheduler, cache = configs(max_num_batched_tokens=2048)
    results = compare_pd(specs, 1, 1, ["pcie", "ethernet-100g"], scheduler, cache, KVCost())
    assert list(results) == ["dp 2", "pd 1P1D pcie", "pd 1P1D ethernet-100g"]
    summaries = {label: result.summary() for label, result in results.items()}
    assert all(s["num_finished"] == 30 for s in summaries.values())
    assert "transfers" not in summaries["dp 2"]
    pulled = [s["transfers"]["seconds"] for label, s in summaries.items() if label != "dp 2"]
    assert pulled[1] == pytest.approx(pulled[0] * 32e9 / 12.5e9)


def test_a_run_does_not_depend_on_the_string_hash_seed():
    """Pulls that end in one step are reported in the order they ended."""
    script = (
        "from tests.sim.test_disaggregation import fleet\n"
        "from cadence.sim.workload import SyntheticWorkload\n"
        "specs = SyntheticWorkload(num_requests=60, rate=800, prompt_len='uniform:50:300',\n"
        "                          output_len='uniform:1:40', seed=5).generate()\n"
        "print(list(fleet(2, 2, num_gpu_blocks=96, max_num_seqs=8).run(specs).recorder.first_token))\n")
    runs = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(runs) == 1
