"""Pinned simulated results: speed work on the core or the simulator must not
change a single digit of what a simulation reports.

Each scenario is a small run of the sim-scale workload's shape (the H100
roofline, Llama-3-8B) bent towards one mechanism: preemption, prefix hits,
chunked prefills, async scheduling, multi-turn conversations, data-parallel
routing. Its digest hashes the exact bits of every per-request metric
(arrival, first and last token, output and cached tokens), every pooled
inter-token gap, the scheduler timeline after each step, the service
buckets and the run's counters. The pins were recorded on the code before
the simulator's speed work (issue 36 item 3); a change that moves one of
them changed the simulation, not just its speed.

To re-pin after a deliberate change of behaviour, print ``digest(...)`` of
each scenario (``python tests/sim/test_sim_pinned.py``) and say why in the
commit.
"""

from __future__ import annotations

import hashlib
import json
from array import array

import pytest

from cadence.config import CacheConfig, SchedulerConfig
from cadence.sim.cost_model import PROFILES, ModelShape, RooflineCostModel
from cadence.sim.simulator import SimResult, Simulator
from cadence.sim.workload import SyntheticWorkload

LLAMA_3_8B = {
    "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
    "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
}

# scenario -> (workload options, scheduler options, cache options)
SCENARIOS = {
    "plain": ({}, {}, {}),
    "preempting": ({"rate": 80.0}, {}, {"num_gpu_blocks": 600}),
    "prefix_groups": ({"prefix_groups": 4, "prefix_fraction": 0.7, "prefix_tokens": 300}, {}, {}),
    "chunked": ({"rate": 60.0}, {"max_num_batched_tokens": 512, "long_prefill_token_threshold": 256},
                {"num_gpu_blocks": 1200}),
    "async": ({"rate": 60.0}, {"async_scheduling": True}, {"num_gpu_blocks": 800}),
    "multi_turn": ({"turns": "fixed:3", "think_time": "exponential:0.5"}, {}, {"num_gpu_blocks": 1500}),
}

PINNED = {
    "plain": "848cfceb1e0388d2ca48e2bbdc00bbc4",
    "preempting": "3d30396c1e68aeba4156b9ea0621885e",
    "prefix_groups": "0f1821e6d1f634475a88077efc61aac6",
    "chunked": "37afe85a9535cf329dd46b217259375a",
    "async": "cb2f6988491d8883a7dce451665472c7",
    "multi_turn": "5d7430410156fc715251e72b251c5cae",
    "dp_round_robin": "9ea9e02c17b1c470938c632f5994ad5a",
    "dp_cache_aware": "91b50e85a3d02c980ae892f09577adb3",
}


def workload(**options):
    base = dict(num_requests=300, rate=40.0, prompt_len="lognormal:512:1.0",
                output_len="lognormal:64:1.0", max_len=2048, seed=0)
    return SyntheticWorkload(**{**base, **options}).generate()


def configs(scheduler_options, cache_options) -> tuple[SchedulerConfig, CacheConfig]:
    scheduler = SchedulerConfig(**{"max_num_seqs": 64, "max_num_batched_tokens": 2048,
                                   "max_model_len": 4096, **scheduler_options})
    cache = CacheConfig(**{"block_size": 16, "enable_prefix_caching": True, **cache_options})
    return scheduler, cache


def cost_model() -> RooflineCostModel:
    return RooflineCostModel(PROFILES["h100"], ModelShape.from_hf_config(LLAMA_3_8B))


def run_scenario(name: str) -> SimResult:
    workload_options, scheduler_options, cache_options = SCENARIOS[name]
    scheduler, cache = configs(scheduler_options, cache_options)
    return Simulator(scheduler, cache, cost_model()).run(workload(**workload_options))


def run_fleet(routing: str) -> SimResult:
    from cadence.sim.replicas import ReplicaFleet

    scheduler, cache = configs({}, {"num_gpu_blocks": 1500})
    fleet = ReplicaFleet(3, routing, scheduler, cache, cost_model())
    return fleet.run(workload(rate=100.0, prefix_groups=4, prefix_fraction=0.7, prefix_tokens=300))


def digest(result: SimResult) -> str:
    """A hash of the exact bits of everything the run measured."""
    recorder = result.recorder

    def bits(values, code: str) -> str:
        values = values if isinstance(values, array) else array(code, values)
        return hashlib.sha256(values.tobytes()).hexdigest()

    timeline = recorder.timeline
    parts = {
        "arrival": bits(recorder.arrival, "d"),
        "first_token": bits(recorder.first_token, "d"),
        "last_token": bits(recorder.last_token, "d"),
        "num_output": bits(recorder.num_output, "q"),
        "num_cached": bits(recorder.num_cached, "q"),
        "finished": bits([int(x) for x in recorder.finished], "b"),
        "rejected": bits([int(x) for x in recorder.rejected], "b"),
        "itl": bits(recorder.itl, "d"),
        "timeline": [bits(timeline.time, "d"), bits(timeline.running, "q"),
                     bits(timeline.waiting, "q"), bits(timeline.kv_usage, "d")],
        "service": sorted((window, sorted(served.items())) for window, served in recorder.service.items()),
        "counters": [result.num_steps, result.num_preemptions, result.clock_s.hex(), result.busy_s.hex()],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_simulated_results_are_pinned(name):
    assert digest(run_scenario(name)) == PINNED[name]


@pytest.mark.parametrize("routing", ["round_robin", "cache_aware"])
def test_data_parallel_results_are_pinned(routing):
    assert digest(run_fleet(routing)) == PINNED[f"dp_{routing}"]


def test_the_preempting_scenario_preempts_and_the_prefix_one_hits():
    """The scenarios exercise what they are named after."""
    assert run_scenario("preempting").num_preemptions > 0
    assert run_scenario("prefix_groups").summary()["prefix_hit_rate"] > 0.1


if __name__ == "__main__":
    for scenario in SCENARIOS:
        print(f'    "{scenario}": "{digest(run_scenario(scenario))}",')
    for routing in ("round_robin", "cache_aware"):
        print(f'    "dp_{routing}": "{digest(run_fleet(routing))}",')
