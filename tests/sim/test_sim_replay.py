"""The same loop on other runners: calibration's timing and the wall-clock replay."""

import time

import pytest
from tests.sim.sim_helpers import LinearCost, configs, specs_at

from cadence.core.sched.scheduler import Scheduler
from cadence.engine.core import EngineCore
from cadence.sim.calibrate import Scenario, fit_trimmed, time_scenarios
from cadence.sim.metrics import MetricsRecorder
from cadence.sim.runner import SimRunner
from cadence.sim.simulator import RequestFactory, WallClock, drive
from cadence.sim.workload import PromptMaker


class SleepyRunner(SimRunner):
    """A simulated runner that really takes its cost in wall time."""

    def execute_model(self, scheduler_output):
        output = super().execute_model(scheduler_output)
        time.sleep(self.last_step_seconds)
        return output


def test_wall_clock_replay_injects_at_arrival_times():
    specs = specs_at([0.0, 0.05, 0.10, 0.15], prompt=20, output=3)
    scheduler_config, cache_config = configs()
    core = EngineCore(Scheduler(scheduler_config, cache_config), SleepyRunner(LinearCost(base=2e-3)))
    recorder = MetricsRecorder(specs)
    start = time.perf_counter()
    drive(core, specs, RequestFactory(PromptMaker(), 2048), WallClock(), recorder)
    assert time.perf_counter() - start >= 0.15
    ttft = [f - a for f, a in zip(recorder.first_token, recorder.arrival)]
    assert all(0.002 <= t < 0.1 for t in ttft)  # one step, plus what the loop was busy with
    assert recorder.num_output == [3] * 4


def test_time_scenarios_reads_the_shape_of_each_step():
    scheduler_config, cache_config = configs()
    scenarios = [Scenario(32, 1, 100, 2), Scenario(2048, 4, 50, 3)]
    shapes, seconds = time_scenarios(SimRunner(LinearCost()), cache_config, 2048, scenarios, vocab_size=500)
    tokens = [s.num_tokens for s in shapes]
    # 100 tokens in chunks of 32, one decode; then 4 prompts in one step and two decodes of 4.
    assert tokens == [32, 32, 32, 4, 1, 200, 4, 4]
    assert [s.num_seqs for s in shapes][-3:] == [4, 4, 4]
    assert len(seconds) == len(shapes) and all(t > 0 for t in seconds)


def test_fit_trimmed_ignores_the_stretched_steps():
    from cadence.sim.cost_model import StepShape

    shapes = [StepShape(t, 1 + t % 7, 3 * t, 0) for t in range(1, 101)]
    seconds = [0.01 + 1e-4 * s.num_tokens + 1e-3 * s.num_seqs for s in shapes]
    for i in range(0, 100, 20):
        seconds[i] *= 3  # another process took the cores
    model = fit_trimmed(shapes, seconds, ("tokens", "seqs"))
    assert model.coefficients["tokens"] == pytest.approx(1e-4, rel=0.02)
    assert model.meta["num_steps_dropped"] == 10


def test_cpu_clock_jumps_idle_gaps_instead_of_sleeping():
    from cadence.sim.simulator import CpuClock

    specs = specs_at([0.0, 30.0], prompt=20, output=3)
    scheduler_config, cache_config = configs()
    core = EngineCore(Scheduler(scheduler_config, cache_config), SimRunner(LinearCost()))
    recorder = MetricsRecorder(specs)
    start = time.perf_counter()
    drive(core, specs, RequestFactory(PromptMaker(), 2048), CpuClock(), recorder)
    assert time.perf_counter() - start < 5.0  # the 30 s gap was not slept
    assert 30.0 <= recorder.first_token[1] < 31.0
    assert recorder.num_output == [3, 3]
