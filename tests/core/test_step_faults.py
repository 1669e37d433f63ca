"""A step the runner raises on is taken back; the request that fails steps is
found and ended alone, and the engine serves the others (core/sched/step_faults.py).

The runner here writes garbage into the shadow KV cache for every position of
the step, as a forward that died half way leaves it, then raises: a later
step that reads a block the failed one was to fill (a prefix-cache hit on
it, or the request's own) fails the shadow check.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cadence.core.kv_cache import plan_kv_cache_layout
from cadence.core.request import RequestStatus
from cadence.core.testing import FakeRunner, all_blocks_free, flatten, greedy_stream, new_request, new_scheduler
from cadence.engine.core import MAX_FAILED_STEPS_IN_A_ROW, EngineCore
from cadence.sim.simulator import ImmediateExecutor

GARBAGE = -1
SHARED = list(range(500, 522))  # a prefix every prompt starts with: 5 full blocks of 4


class FaultyRunner(FakeRunner):
    """Raises on every step that holds ``bad_id``, and on the steps numbered in
    ``fail_steps`` (1 is the first), after writing garbage where the step writes."""

    def __init__(self, block_size: int, bad_id: str | None = None, fail_steps=(), always: bool = False,
                 sliding_windows=None):
        super().__init__(block_size=block_size, check_kv=True, sliding_windows=sliding_windows)
        self.bad_id, self.fail_steps, self.always = bad_id, set(fail_steps), always
        self.num_failed = 0

    def execute_model(self, scheduler_output):
        if self._fails(scheduler_output):
            self.num_steps += 1
            self.num_failed += 1
            self._update_states(scheduler_output)
            for req_id, num in scheduler_output.num_scheduled_tokens.items():
                start, tables = self.computed[req_id], self.block_ids[req_id]
                for table in tables if isinstance(tables, tuple) else (tables,):
                    self.shadow_kv.write(table, [GARBAGE] * (start + num), start, start + num)
            raise RuntimeError("the kernel fell over")
        return super().execute_model(scheduler_output)

    def _fails(self, scheduler_output) -> bool:
        return (self.always or self.num_steps + 1 in self.fail_steps
                or (self.bad_id is not None and self.bad_id in scheduler_output.num_scheduled_tokens))


def make_core(runner: FaultyRunner, async_scheduling: bool = False, **options) -> EngineCore:
    scheduler = new_scheduler(enable_prefix_caching=True, async_scheduling=async_scheduling, **options)
    return EngineCore(scheduler, runner, async_scheduling=async_scheduling)


def drive(core: EngineCore, max_steps: int = 3000) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Step until done: each request's streamed tokens, and the requests ended with an error."""
    streams: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    for _ in range(max_steps):
        if not core.has_work():
            return streams, errors
        for out in flatten(core.step()):
            streams.setdefault(out.request_id, []).extend(out.new_token_ids)
        errors.update(core.take_request_errors())
        core.scheduler.kv_cache_manager.check_consistency()
    raise AssertionError("requests left")


def shared_prompt(i: int, length: int) -> list[int]:
    return SHARED + [3000 + 100 * i + k for k in range(length)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_one_bad_request_ends_alone_and_the_others_are_greedy(async_scheduling):
    runner = FaultyRunner(block_size=4, bad_id="r3")
    core = make_core(runner, async_scheduling)
    prompts = {f"r{i}": shared_prompt(i, 3 + 5 * i) for i in range(6)}
    for req_id, prompt in prompts.items():
        core.add_request(new_request(req_id, prompt, max_tokens=12))
    streams, errors = drive(core)
    assert list(errors) == ["r3"]
    assert "model runner failed on this request: RuntimeError: the kernel fell over" in errors["r3"]
    for req_id, prompt in prompts.items():
        if req_id != "r3":
            assert streams[req_id] == greedy_stream(prompt, 12), req_id
    scheduler = core.scheduler
    assert all_blocks_free(scheduler) and not scheduler.suspects and not scheduler.freed_in_flight
    assert core.num_failed_steps >= 2  # the step of all six, then r3's among the suspects


def test_taken_back_requests_are_sent_anew_and_their_rows_dropped():
    runner = FaultyRunner(block_size=4, fail_steps={3})
    core = make_core(runner)
    for i in range(3):
        core.add_request(new_request(f"r{i}", shared_prompt(i, 6), max_tokens=8))
    for _ in range(3):
        core.step()  # the third fails
    scheduler = core.scheduler
    assert scheduler.suspects == {"r0", "r1", "r2"}
    assert all(scheduler.requests[r].status == RequestStatus.WAITING for r in scheduler.suspects)
    assert scheduler.get_request_counts() == (0, 3)
    following = scheduler.schedule()
    assert following.preempted_req_ids == {"r0", "r1", "r2"}
    (resent,) = following.scheduled_new_reqs  # one suspect at a time
    assert len(resent.output_token_ids) == 2  # the two tokens it had, sent with it
    assert list(following.num_scheduled_tokens) == [resent.req_id]


def test_a_fault_of_every_step_stops_the_engine_after_a_few():
    runner = FaultyRunner(block_size=4, always=True)
    core = make_core(runner)
    for i in range(5):
        core.add_request(new_request(f"r{i}", shared_prompt(i, 4), max_tokens=4))
    with pytest.raises(RuntimeError, match="the kernel fell over"):
        for _ in range(20):
            core.step()
    assert runner.num_failed == MAX_FAILED_STEPS_IN_A_ROW + 1


def test_a_single_request_failing_alone_is_ended_and_the_engine_goes_on():
    runner = FaultyRunner(block_size=4, bad_id="bad")
    core = make_core(runner)
    core.add_request(new_request("bad", shared_prompt(0, 5), max_tokens=4))
    streams, errors = drive(core)
    assert list(errors) == ["bad"] and core.num_failed_steps == 1
    core.add_request(new_request("good", shared_prompt(1, 5), max_tokens=4))
    streams, errors = drive(core)
    assert streams["good"] == greedy_stream(shared_prompt(1, 5), 4) and not errors
    assert all_blocks_free(core.scheduler)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 30), min_size=2, max_size=9),
    max_tokens=st.integers(1, 12),
    fail_after=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    async_scheduling=st.booleans(),
    num_gpu_blocks=st.sampled_from([24, 40, 96]),
    budget=st.sampled_from([8, 16, 64]),
    windowed=st.booleans(),
)
def test_transient_faults_never_leave_a_wrong_block_or_lose_a_request(
        lengths, max_tokens, fail_after, async_scheduling, num_gpu_blocks, budget, windowed):
    """Faults at random steps (never three in a row) over shared prefixes,
    chunked prefills and preemption, with one table or a full and a window
    group: every request either streams its greedy tokens or is the one a
    failed step was laid on, and no step reads a block a failed step wrote
    (the shadow check)."""
    fail_steps, step = set(), 0
    for gap in fail_after:
        step += gap + 2
        fail_steps.add(step)
    layout = plan_kv_cache_layout(2, 8, (1,)) if windowed else None  # layer 0 sees 8 tokens
    if windowed:  # a prompt takes its window group's blocks too before it frees them
        num_gpu_blocks = max(num_gpu_blocks, 40)
    runner = FaultyRunner(block_size=4, fail_steps=fail_steps,
                          sliding_windows=layout.sliding_windows if layout else None)
    core = make_core(runner, async_scheduling, num_gpu_blocks=num_gpu_blocks, max_num_batched_tokens=budget,
                     kv_cache_layout=layout)
    prompts = {f"r{i}": shared_prompt(i, n) for i, n in enumerate(lengths)}
    for req_id, prompt in prompts.items():
        core.add_request(new_request(req_id, prompt, max_tokens=max_tokens))
    streams, errors = drive(core)
    assert len(errors) <= runner.num_failed
    for req_id, prompt in prompts.items():
        if req_id not in errors:
            assert streams[req_id] == greedy_stream(prompt, max_tokens), req_id
    assert all_blocks_free(core.scheduler) and not core.scheduler.suspects


def test_blocks_of_a_request_aborted_while_its_failed_step_ran_are_forgotten_too():
    """With async scheduling a request can end (here: aborted) between the step
    that fails and the core hearing of it; the blocks that step entered in the
    prefix cache for it go too, or a later request with its prompt reads them."""
    runner = FaultyRunner(block_size=4, fail_steps={3})
    scheduler = new_scheduler(enable_prefix_caching=True, async_scheduling=True, max_num_batched_tokens=12)
    core = EngineCore(scheduler, runner, async_scheduling=True, executor=ImmediateExecutor())
    long_prompt = shared_prompt(9, 30)  # prefilled 8 tokens a step beside the others' decodes
    core.add_request(new_request("a", shared_prompt(1, 2), max_tokens=20))
    core.add_request(new_request("b", shared_prompt(2, 2), max_tokens=20))
    core.add_request(new_request("long", long_prompt, max_tokens=2))
    core.step()  # steps 1 and 2 scheduled, 1 absorbed
    core.step()  # step 3 scheduled (and failed on the worker), 2 absorbed
    scheduler.cancel_request("long")
    core.step()  # step 4's schedule ends "long"; then step 3's failure is heard
    assert core.num_failed_steps == 1 and "long" not in scheduler.requests
    core.add_request(new_request("again", long_prompt, max_tokens=2))
    streams, errors = drive(core)
    assert streams["again"] == greedy_stream(long_prompt, 2)
    assert all_blocks_free(scheduler) and not scheduler.freed_in_flight
