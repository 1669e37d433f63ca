"""Async scheduling in the simulator: the same requests end with the same
lengths, one step in flight ahead; with the host's time charged, a step
costs model + host synchronously and the slower of the two overlapped."""

import pytest
from tests.sim.sim_helpers import LinearCost, configs, specs_at

from cadence.sim.runner import ExecutedStep, SimRunner
from cadence.sim.cost_model import StepShape
from cadence.sim.simulator import Simulator, VirtualClock
from cadence.sim.workload import SyntheticWorkload


def run(specs, cost=None, **options):
    simulator = Simulator(*configs(**options), cost or LinearCost())
    return simulator, simulator.run(specs)


def test_lengths_and_blocks_as_in_the_synchronous_loop():
    specs = SyntheticWorkload(num_requests=150, rate=40, prompt_len="uniform:1:300",
                              output_len="uniform:1:60", seed=5).generate()
    sync_sim, sync = run(specs)
    async_sim, overlapped = run(specs, async_scheduling=True)
    assert overlapped.recorder.num_output == sync.recorder.num_output == [s.output_tokens for s in specs]
    assert async_sim.core.async_scheduling and not async_sim.core.in_flight
    assert async_sim.scheduler.kv_cache_manager.usage == 0.0
    # The same work, costed alike: the model's busy time barely moves.
    assert overlapped.busy_s == pytest.approx(sync.busy_s, rel=0.05)


def test_lengths_are_honoured_through_preemption():
    specs = specs_at([0.0] * 12, prompt=100, output=40)
    simulator, result = run(specs, num_gpu_blocks=40, max_num_batched_tokens=512, async_scheduling=True)
    assert result.num_preemptions > 0
    assert result.recorder.num_output == [40] * 12
    assert simulator.scheduler.kv_cache_manager.usage == 0.0


class FakeTimer:
    """Each read is ``step`` seconds after the last: every step's host time is ``step``."""

    def __init__(self, step: float) -> None:
        self.step, self.now, self.reads = step, 0.0, 0

    def __call__(self) -> float:
        self.reads += 1
        if self.reads % 2 == 0:  # the read at a step's end
            self.now += self.step
        return self.now


@pytest.mark.parametrize("overlapped, host, want", [
    (False, 0.004, [0.014, 0.002 + 0.004]),
    (True, 0.004, [0.010, 0.004]),
    (True, 0.0, [0.010, 0.002]),
])
def test_host_time_is_added_or_overlapped(overlapped, host, want):
    runner = SimRunner(LinearCost())
    clock = VirtualClock(runner, charge_host_time=True, overlapped=overlapped, host_timer=FakeTimer(host))
    shape = StepShape(1, 1, 1, 1)
    runner.executed.extend([ExecutedStep(0.010, shape, 0), ExecutedStep(0.002, shape, 0)])
    costs = []
    for _ in range(2):
        before = clock.now
        clock.before_step()
        costs.append(clock.after_step() - before)
    assert costs == pytest.approx(want)
    assert clock.host_seconds == pytest.approx(2 * host)


def test_charged_host_time_lengthens_a_synchronous_run_more():
    specs = specs_at([0.0] * 40, prompt=50, output=30)
    results = {}
    for overlapped in (False, True):
        simulator = Simulator(*configs(async_scheduling=overlapped), LinearCost(base=1e-6, per_token=0.0),
                              charge_host_time=True)
        simulator.clock.host_timer = FakeTimer(1e-3)  # host-bound: 1 ms a step against 1 us of model
        results[overlapped] = simulator.run(specs)
    sync, overlapped = results[False], results[True]
    assert sync.clock_s == pytest.approx(sync.num_steps * (1e-3 + 1e-6), rel=0.01)
    assert overlapped.clock_s == pytest.approx(overlapped.num_steps * 1e-3, rel=0.01)
