"""SimRunner: the runner interface on the real scheduler."""

from tests.sim.sim_helpers import LinearCost, configs

from cadence.core.request import Request
from cadence.core.sched.scheduler import Scheduler
from cadence.engine.core import EngineCore
from cadence.sampling_params import SamplingParams
from cadence.sim.cost_model import StepShape, step_shape
from cadence.sim.runner import FILLER_TOKEN_ID, SimRunner


def test_prefill_chunks_sample_nothing_and_the_last_chunk_samples():
    scheduler = Scheduler(*configs(max_num_batched_tokens=64))
    runner = SimRunner(LinearCost())
    scheduler.add_request(Request("a", list(range(150)), SamplingParams(max_tokens=3, ignore_eos=True)))
    sampled = []
    while scheduler.has_requests():
        output = scheduler.schedule()
        runner_output = runner.execute_model(output)
        sampled.append([len(t) for t in runner_output.sampled_token_ids])
        scheduler.update_from_output(output, runner_output)
    # 150 tokens in chunks of 64: 64, 64, 22 (samples), then two decodes, then the flush step.
    assert sampled == [[0], [0], [1], [1], [1], []]


def test_runner_shape_equals_step_shape_of_the_scheduler_output():
    scheduler = Scheduler(*configs(max_num_batched_tokens=100))
    runner = SimRunner(LinearCost())
    for i in range(5):
        scheduler.add_request(Request(str(i), list(range(i * 1000, i * 1000 + 30 + 17 * i)),
                                      SamplingParams(max_tokens=6, ignore_eos=True)))
    shapes = []
    while scheduler.has_requests():
        output = scheduler.schedule()
        runner_output = runner.execute_model(output)
        assert runner.last_shape == step_shape(output)
        shapes.append(runner.last_shape)
        scheduler.update_from_output(output, runner_output)
    # First step: a 30-token prompt and a 47-token one, then 23 tokens of the third.
    assert shapes[0] == StepShape(100, 3, 100, 30 * 31 // 2 + 47 * 48 // 2 + 23 * 24 // 2)


def test_tokens_are_filler_and_the_engine_core_runs_unchanged():
    scheduler = Scheduler(*configs())
    core = EngineCore(scheduler, SimRunner(LinearCost()))
    core.add_request(Request("x", [5] * 20, SamplingParams(max_tokens=4, ignore_eos=True), eos_token_id=FILLER_TOKEN_ID))
    tokens = []
    while core.has_work():
        for outputs in core.step().values():
            for out in outputs.outputs:
                tokens += out.new_token_ids
    assert tokens == [FILLER_TOKEN_ID] * 4  # EOS ignored: the target length decides
