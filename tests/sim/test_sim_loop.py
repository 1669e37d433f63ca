"""The virtual-clock loop: lengths, clock, arrivals, stalls, preemption."""

import pytest
from tests.sim.sim_helpers import LinearCost, configs, specs_at

from cadence.sim.simulator import Simulator, SimulationStalled
from cadence.sim.workload import RequestSpec, SyntheticWorkload


def run(specs, cost=None, **options):
    cost = cost or LinearCost()
    simulator = Simulator(*configs(**options), cost)
    return simulator, simulator.run(specs)


def test_each_request_gets_exactly_its_target_output_length():
    specs = SyntheticWorkload(num_requests=200, rate=50, prompt_len="uniform:1:300",
                              output_len="uniform:1:60", seed=3).generate()
    _, result = run(specs)
    recorder = result.recorder
    assert all(recorder.finished)
    assert recorder.num_output == [s.output_tokens for s in specs]


def test_lengths_are_honoured_through_preemption():
    # 40 blocks of 16 tokens hold ~5 of these requests at full length: preemption by recompute.
    specs = specs_at([0.0] * 12, prompt=100, output=40)
    simulator, result = run(specs, num_gpu_blocks=40, max_num_batched_tokens=512)
    assert result.num_preemptions > 0
    assert result.recorder.num_output == [40] * 12
    assert simulator.scheduler.kv_cache_manager.usage == 0.0  # nothing leaked


def test_output_capped_by_the_context_length():
    _, result = run([RequestSpec(0.0, 90, 50)], max_model_len=100)
    assert result.recorder.num_output == [10]


def test_clock_is_monotone_and_the_sum_of_step_costs():
    cost = LinearCost()
    specs = specs_at([0.0] * 20, prompt=300, output=12)  # all at t=0: the engine is never idle
    _, result = run(specs, cost=cost)
    times = list(result.recorder.timeline.time)
    assert times == sorted(times)
    assert len(cost.charged) == result.num_steps
    assert result.clock_s == pytest.approx(sum(cost.charged), rel=1e-12)
    assert result.busy_s == pytest.approx(result.clock_s, rel=1e-12)


def test_idle_gaps_jump_to_the_next_arrival():
    cost = LinearCost()
    _, result = run(specs_at([0.0, 100.0], output=4), cost=cost)
    assert result.busy_s == pytest.approx(sum(cost.charged))
    assert result.clock_s == pytest.approx(100.0 + result.busy_s / 2, rel=1e-9)  # two equal requests


def test_no_request_is_scheduled_before_it_arrives():
    specs = SyntheticWorkload(num_requests=150, rate=30, prompt_len="uniform:10:400",
                              output_len="uniform:1:30", seed=1).generate()
    simulator = Simulator(*configs(), LinearCost())
    arrival = {str(i): s.arrival_time for i, s in enumerate(specs)}
    first_scheduled: dict[str, float] = {}
    inner = simulator.runner.execute_model

    def spy(scheduler_output):
        now = simulator.clock.now  # the step starts now
        for new_req in scheduler_output.scheduled_new_reqs:
            first_scheduled.setdefault(new_req.req_id, now)
        return inner(scheduler_output)

    simulator.core.runner.execute_model = spy
    result = simulator.run(specs)
    assert len(first_scheduled) == len(specs)
    assert all(first_scheduled[r] >= arrival[r] for r in arrival)
    # TTFT is counted from the arrival, never negative, and at least one step.
    recorder = result.recorder
    assert all(f - a >= 1e-3 for f, a in zip(recorder.first_token, recorder.arrival))


def test_a_request_that_can_never_fit_stalls_loudly():
    with pytest.raises(SimulationStalled):
        run([RequestSpec(0.0, 1000, 4)], num_gpu_blocks=8)


def test_prompts_longer_than_the_context_are_rejected_not_run():
    _, result = run([RequestSpec(0.0, 50, 4), RequestSpec(0.0, 3000, 4)])
    summary = result.summary()
    assert summary["num_rejected"] == 1 and summary["num_finished"] == 1
