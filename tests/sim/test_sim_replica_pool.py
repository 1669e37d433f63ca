"""Round-robin replicas run in parallel processes give the fleet's results to the bit."""

from __future__ import annotations

import json

import pytest

from cadence.sim.replica_pool import ParallelReplicaFleet
from cadence.sim.replicas import ReplicaFleet
from cadence.sim.workload import RequestSpec

from .test_sim_cli import parse
from .test_sim_pinned import PINNED, configs, cost_model, digest, workload


@pytest.mark.parametrize("max_workers", [1, 3])
def test_parallel_replicas_equal_the_pinned_fleet(max_workers):
    """In processes (3) and in this one (1): the pinned sequential fleet's digest."""
    scheduler, cache = configs({}, {"num_gpu_blocks": 1500})
    fleet = ParallelReplicaFleet(3, "round_robin", scheduler, cache, cost_model(), max_workers=max_workers)
    result = fleet.run(workload(rate=100.0, prefix_groups=4, prefix_fraction=0.7, prefix_tokens=300))
    assert digest(result) == PINNED["dp_round_robin"]
    assert fleet.requests_per_replica() == [100, 100, 100]


def test_rejections_preemptions_and_async_steps_match_the_fleet():
    """Prompts longer than the context skip their turn; preemptions and
    overlapped steps come out alike; equal arrival times keep the fleet's order."""
    scheduler, cache = configs({"async_scheduling": True, "max_model_len": 1024}, {"num_gpu_blocks": 300})
    specs = workload(num_requests=150, rate=200.0)
    specs += [RequestSpec(specs[-1].arrival_time, 64, 8) for _ in range(4)]  # ties
    expected = ReplicaFleet(2, "round_robin", scheduler, cache, cost_model())
    result = expected.run(specs)
    assert result.num_preemptions > 0 and any(result.recorder.rejected)
    parallel = ParallelReplicaFleet(2, "round_robin", scheduler, cache, cost_model(), max_workers=2)
    assert digest(parallel.run(specs)) == digest(result)
    assert parallel.requests_per_replica() == expected.requests_per_replica()


def test_routing_that_reads_the_replicas_state_is_refused():
    scheduler, cache = configs({}, {})
    with pytest.raises(ValueError, match="^parallel_replicas: routing 'cache_aware'"):
        ParallelReplicaFleet(2, "cache_aware", scheduler, cache, cost_model())


def test_cli_parallel_replicas_report_what_the_sequential_run_reports(tmp_path):
    summaries = []
    for flag in ([], ["--parallel-replicas"]):
        out = tmp_path / f"out{len(flag)}"
        args = parse(["simulate", "--data-parallel-size", "2", "--dp-routing", "round_robin",
                      "--num-requests", "60", "--rate", "40", "--out", str(out), *flag])
        assert args.func(args) == 0
        summary = json.loads((out / "summary.json").read_text())["policies"]["round_robin"]
        summary.pop("sim_wall_s")
        summaries.append(summary)
    assert summaries[0] == summaries[1]


@pytest.mark.parametrize("flags", [["--dp-routing", "round_robin,least_loaded"], ["--data-parallel-size", "1"]])
def test_cli_parallel_replicas_refuses_what_cannot_run_apart(flags):
    args = parse(["simulate", "--data-parallel-size", "2", "--num-requests", "4", "--parallel-replicas", *flags])
    with pytest.raises(ValueError, match="^parallel_replicas:"):
        args.func(args)
