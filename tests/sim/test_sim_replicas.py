"""Data-parallel replicas in the simulator (``cadence.sim.replicas``): N real
schedulers behind the front end's router, on one virtual clock."""

from __future__ import annotations

import numpy as np
import pytest

from cadence.sim.replicas import ReplicaFleet, compare_routing
from cadence.sim.simulator import Simulator, SimulationStalled
from cadence.sim.workload import RequestSpec, SyntheticWorkload
from tests.sim.sim_helpers import LinearCost, configs, specs_at


def test_one_replica_runs_exactly_as_the_plain_simulator():
    specs = SyntheticWorkload(num_requests=60, rate=80, prompt_len="uniform:20:200",
                              output_len="uniform:1:30", prefix_groups=3, seed=3).generate()
    scheduler, cache = configs(num_gpu_blocks=256)
    plain = Simulator(scheduler, cache, LinearCost()).run(specs)
    for routing in ("round_robin", "cache_aware"):
        fleet = ReplicaFleet(1, routing, scheduler, cache, LinearCost()).run(specs)
        for name in ("first_token", "last_token", "num_cached"):
            np.testing.assert_array_equal(getattr(fleet.recorder, name),
                                          getattr(plain.recorder, name))
        assert fleet.num_steps == plain.num_steps


def test_round_robin_deals_requests_in_turn_and_every_replica_ends_empty():
    scheduler, cache = configs(num_gpu_blocks=64)
    fleet = ReplicaFleet(3, "round_robin", scheduler, cache, LinearCost())
    result = fleet.run(specs_at([0.001 * i for i in range(30)]))
    assert fleet.requests_per_replica() == [10, 10, 10]
    assert all(result.recorder.finished)
    for replica in fleet.replicas:
        replica.core.scheduler.kv_cache_manager.check_consistency()
        assert replica.core.scheduler.kv_cache_manager.usage == 0
    assert fleet.router.loads == [0, 0, 0] and not fleet.router.routed


def test_cache_aware_routing_beats_round_robin_on_shared_prefixes():
    """16 prefix groups of 512 tokens; a replica's cache holds about 5 of them:
    round robin makes every replica cycle through all 16, the cache-aware router
    keeps each group on one replica."""
    specs = SyntheticWorkload(num_requests=400, rate=200, prompt_len="fixed:600",
                              output_len="fixed:4", prefix_groups=16, prefix_fraction=1.0,
                              prefix_tokens=512, seed=1).generate()
    scheduler, cache = configs(num_gpu_blocks=200, max_num_batched_tokens=2048)
    results = compare_routing(specs, ["round_robin", "least_loaded", "cache_aware"], 4,
                              scheduler, cache, LinearCost())
    summaries = {name: run.summary() for name, (run, _) in results.items()}
    assert all(s["num_finished"] == 400 for s in summaries.values())
    assert summaries["cache_aware"]["prefix_hit_rate"] > 0.7
    assert summaries["round_robin"]["prefix_hit_rate"] < 0.5
    assert summaries["cache_aware"]["ttft_s"]["p50"] < summaries["round_robin"]["ttft_s"]["p50"]
    assert sum(results["cache_aware"][1]) == 400


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_no_replica_can_hold_stalls_the_run_with_a_clear_error(async_scheduling):
    scheduler, cache = configs(num_gpu_blocks=4, async_scheduling=async_scheduling)
    with pytest.raises(SimulationStalled, match="can never be scheduled"):
        ReplicaFleet(2, "least_loaded", scheduler, cache, LinearCost()).run(specs_at([0.0], prompt=500))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_stuck_request_behind_finished_ones_stalls_and_does_not_spin(async_scheduling):
    """One replica: the first request finishes, the second can never fit and holds the
    FCFS queue (the third waits behind it). With async scheduling one empty step
    stays in flight behind another once nothing can run; counted as progress, it
    kept the run looping forever."""
    scheduler, cache = configs(num_gpu_blocks=8, async_scheduling=async_scheduling)
    specs = [RequestSpec(0.0, 40, 8), RequestSpec(0.001, 500, 4), RequestSpec(0.002, 40, 30)]
    fleet = ReplicaFleet(1, "round_robin", scheduler, cache, LinearCost())
    with pytest.raises(SimulationStalled, match="2 requests can never be scheduled"):
        fleet.run(specs)
