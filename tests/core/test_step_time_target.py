"""step_time_target_s: the running batch grows only while the step-time model
predicts a step of one token per running request within the target."""

from __future__ import annotations

import random

import pytest

from cadence.config import SchedulerConfig
from cadence.core.sched.scheduler import COLD_START_SEATS, MIN_STEPS_TIMED
from cadence.core.step_time import TIMES_TO_TRUST, StepTimeModel, StepTimer
from tests.core.scheduler_sim import ModelRunnerSim, make_request, make_scheduler, step

BASE_S, PER_TOKEN_S = 0.010, 0.002  # the simulated engine: 10 ms + 2 ms a token


class SteppedClock:
    """A clock that advances by the last step's cost when the step has run."""

    def __init__(self, base_s: float = BASE_S, per_token_s: float = PER_TOKEN_S) -> None:
        self.now = 0.0
        self.base_s, self.per_token_s = base_s, per_token_s

    def __call__(self) -> float:
        return self.now

    def run(self, num_tokens: int) -> None:
        self.now += self.base_s + self.per_token_s * num_tokens

    def run_step(self, num_scheduled_tokens: dict[str, int]) -> None:
        """A decoded token costs per_token_s, a prompt token a tenth of it."""
        decodes = sum(1 for n in num_scheduled_tokens.values() if n == 1)
        prompt = sum(n for n in num_scheduled_tokens.values() if n > 1)
        self.now += self.base_s + self.per_token_s * (decodes + prompt / 10)


def run_timed(target_s: float | None, num_requests: int = 60, max_tokens: int = 120, prompt_len: int = 6,
              **options):
    """Two requests arrive before every third step until all have; the clock
    runs each step's cost (the bound learns from the steps without a prompt)."""
    clock = SteppedClock()
    scheduler = make_scheduler(max_num_seqs=64, max_num_batched_tokens=512, num_blocks=2000,
                               step_time_target_s=target_s, clock=clock, **options)
    runner = ModelRunnerSim(4)
    running, finished, num_added = [], set(), 0
    num_steps = 0
    while num_added < num_requests or scheduler.has_requests():
        if num_steps % 3 == 0:
            for i in range(num_added, min(num_added + 2, num_requests)):
                scheduler.add_request(make_request(f"r{i}", prompt_len, max_tokens=max_tokens,
                                                   arrival_time=clock.now))
            num_added = min(num_added + 2, num_requests)
        num_steps += 1
        output, engine_outputs = step(scheduler, runner)
        clock.run_step(output.num_scheduled_tokens)
        running.append(len(scheduler.running))
        finished.update(o.request_id for o in engine_outputs if o.finish_reason is not None)
    return scheduler, running, finished


def test_the_running_batch_holds_what_the_target_allows():
    # 10 ms + 2 ms a token: 20 decodes make a 50 ms step.
    scheduler, running, finished = run_timed(0.05)
    assert len(finished) == 60  # every request ran: later ones queued, none starved
    assert max(running) <= 20 + 2 * MIN_STEPS_TIMED  # before the model learned: 2 a step
    assert 18 <= running[len(running) // 2] <= 20
    assert scheduler.running_seats() == 20


def test_the_bound_learns_from_decode_steps_only():
    # 200-token prompts at a tenth of a decoded token's cost: a fit over every
    # step would find a smaller per-token cost and a larger base, and more seats.
    scheduler, running, finished = run_timed(0.05, prompt_len=200)
    assert len(finished) == 60
    base_s, per_token_s = scheduler._step_timer.model.theta
    assert (base_s, per_token_s) == (pytest.approx(BASE_S, rel=0.01), pytest.approx(PER_TOKEN_S, rel=0.01))
    assert scheduler.running_seats() == 20 and max(running) <= 20


def test_a_cold_start_under_a_stream_of_long_prompts_is_bounded():
    # A 400-token prompt arrives before every step: a step that admits one is
    # not learned, so a cold start that admitted every arrival would leave the
    # model no step to learn from while all of them decode ever slower.
    clock = SteppedClock()
    scheduler = make_scheduler(max_num_seqs=64, max_num_batched_tokens=512, num_blocks=4000,
                               step_time_target_s=0.05, clock=clock)
    runner = ModelRunnerSim(4)
    running = []
    for i in range(60):
        scheduler.add_request(make_request(f"r{i}", 400, max_tokens=120, arrival_time=clock.now))
        output, _ = step(scheduler, runner)
        clock.run_step(output.num_scheduled_tokens)
        running.append(len(scheduler.running))
    assert running[:MIN_STEPS_TIMED] == [min(i + 1, COLD_START_SEATS) for i in range(MIN_STEPS_TIMED)]
    assert max(running) == 20 and scheduler.running_seats() == 20
    assert len(scheduler.waiting) == 40


def test_the_seats_grow_at_most_twofold_past_the_largest_step_timed():
    # An engine of 5 ms + 4 ms a decoded token (a 2-core CPU): 45 ms is 10
    # decodes (6 single-stream steps would be more, but none ran alone: the
    # smallest step per token, 5.25 ms, bounds them from below, 31.5 ms). The
    # first steps all decode 4 tokens (21 ms): their fit keeps the prior's 10 ms
    # base, and gives 13 seats; admitted at once, those 13 would run to their ends.
    clock = SteppedClock(base_s=0.005, per_token_s=0.004)
    scheduler = make_scheduler(max_num_seqs=64, max_num_batched_tokens=512, num_blocks=4000,
                               step_time_target_s=0.045, step_time_target_solo_steps=6, clock=clock)
    runner = ModelRunnerSim(4)
    for i in range(40):
        scheduler.add_request(make_request(f"r{i}", 100, max_tokens=200, arrival_time=0.0))
    running = []
    for _ in range(100):
        output, _ = step(scheduler, runner)
        clock.run_step(output.num_scheduled_tokens)
        running.append(len(scheduler.running))
    assert running[:MIN_STEPS_TIMED + 1] == [4] * (MIN_STEPS_TIMED + 1)
    assert max(running) == 10 and running[-1] == 10 and scheduler.running_seats() == 10


def test_without_a_target_max_num_seqs_is_the_only_bound():
    _, running, finished = run_timed(None)
    assert len(finished) == 60 and max(running) == 60


@pytest.mark.parametrize("target_s", [0, None])
def test_zero_or_none_is_no_bound(target_s):
    scheduler, running, _ = run_timed(target_s)
    assert max(running) == 60 and scheduler.running_seats() == 64


def test_a_target_no_step_meets_still_runs_one_request_at_a_time():
    scheduler, running, finished = run_timed(0.005, num_requests=30, max_tokens=30)
    assert len(finished) == 30
    assert scheduler.running_seats() == 1
    assert max(running[-20:]) == 1  # the last ones, one by one


def test_solo_steps_raise_the_target_to_a_slow_models_own_pace():
    # One stream's step is 12 ms: two of them, 24 ms, are 7 decodes. Until a
    # stream ran alone, the smallest step timed per token (4 decodes, 4.5 ms)
    # bounds it from below: 9 ms, under the 10 ms base, one seat.
    scheduler, running, finished = run_timed(0.005, num_requests=30, max_tokens=30,
                                             step_time_target_solo_steps=2)
    assert len(finished) == 30
    assert scheduler._step_timer.solo_s == pytest.approx(BASE_S + PER_TOKEN_S)
    assert scheduler.running_seats() == 7
    alone = running.index(1)
    assert max(running[:alone]) == COLD_START_SEATS and max(running[alone:]) == 7


def test_a_fit_from_steps_of_one_size_keeps_learning():
    # Warm-up steps of one token each split their error between base and
    # per-token cost; the per-token cost went negative, every later prediction
    # fell to the floor, and every real step looked like an idle gap: the fit
    # froze and the bound was off for good.
    now = [0.0]
    timer = StepTimer(lambda: now[0], StepTimeModel(per_token_doubt=1.0))
    for tokens, seconds in [(1, 0.005)] * 6 + [(20, 0.050), (30, 0.070)] * 10:
        timer.step_begins()
        timer.step_planned(tokens)
        now[0] += seconds
    timer.step_begins()
    assert timer.model.num_observed == 26
    assert timer.model.predict(20) == pytest.approx(0.050, rel=0.05)


def test_a_step_size_counts_as_timed_once_learned_a_few_times():
    now = [0.0]
    timer = StepTimer(lambda: now[0], StepTimeModel(per_token_doubt=1.0))
    seen = []
    for tokens in [4] * TIMES_TO_TRUST + [8] * (TIMES_TO_TRUST - 1) + [2, 8]:
        timer.step_begins()
        timer.step_planned(tokens)
        now[0] += 0.01 + 0.002 * tokens
        timer.step_begins()
        seen.append(timer.max_tokens_timed)
    assert seen == [0] * (TIMES_TO_TRUST - 1) + [4] * TIMES_TO_TRUST + [4, 8]


class ConcaveClock(SteppedClock):
    """A CPU's decode steps: 2 ms + 6.5 ms a token up to 8, then 3.5 ms each
    more (larger products run faster per row), 20% noise either way."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.rng = random.Random(seed)

    def run_step(self, num_scheduled_tokens: dict[str, int]) -> None:
        decodes = sum(1 for n in num_scheduled_tokens.values() if n == 1)
        prompt = sum(n for n in num_scheduled_tokens.values() if n > 1)
        cost = 0.002 + 0.0065 * decodes if decodes <= 8 else 0.054 + 0.0035 * (decodes - 8)
        self.now += (cost + 0.0004 * prompt) * self.rng.uniform(0.8, 1.2)


@pytest.mark.parametrize("seed", [1, 2])
def test_a_floor_of_single_streams_no_stream_ran_does_not_feed_on_itself(seed):
    # A burst, then a request every third step; no stream ever runs alone. The
    # fit's one-token prediction was the floor's single stream: over large
    # steps its base rose, the floor and the seats with it, and the steps grew
    # larger still (55 and 64 streams at 60-190 ms a step, from these seeds).
    clock = ConcaveClock(seed)
    scheduler = make_scheduler(max_num_seqs=64, max_num_batched_tokens=512, num_blocks=4000,
                               step_time_target_s=0.045, step_time_target_solo_steps=6,
                               step_time_max_wait_s=0.5, clock=clock)
    runner = ModelRunnerSim(4)
    for i in range(30):
        scheduler.add_request(make_request(f"burst{i}", 60, max_tokens=128, arrival_time=0.0))
    running = []
    for k in range(600):
        if k % 3 == 0:
            scheduler.add_request(make_request(f"r{k}", 60, max_tokens=128, arrival_time=clock.now))
        output, _ = step(scheduler, runner)
        clock.run_step(output.num_scheduled_tokens)
        running.append(len(scheduler.running))
    assert scheduler._step_timer.solo_s is None
    assert max(running) <= 8 and running[-1] == scheduler.running_seats() == 6  # 45 ms: 6.6 decodes


def test_a_fit_with_no_cost_per_token_still_grows_by_doubling():
    # A fast engine (8 ms steps of 4 tokens, under the prior's 10 ms base):
    # the fit from one size gives a token no cost; the bound still holds.
    clock = SteppedClock(base_s=0.006, per_token_s=0.0005)
    scheduler = make_scheduler(max_num_seqs=64, max_num_batched_tokens=512, num_blocks=4000,
                               step_time_target_s=0.045, clock=clock)
    runner = ModelRunnerSim(4)
    for i in range(64):
        scheduler.add_request(make_request(f"r{i}", 20, max_tokens=400, arrival_time=0.0))
    running = []
    for _ in range(4 * MIN_STEPS_TIMED):
        output, _ = step(scheduler, runner)
        clock.run_step(output.num_scheduled_tokens)
        running.append(len(scheduler.running))
    assert running[:MIN_STEPS_TIMED + 2] == [COLD_START_SEATS] * (MIN_STEPS_TIMED + 1) + [2 * COLD_START_SEATS]
    assert running[-1] == 64 and scheduler.running_seats() == 64  # 78 would fit


def test_no_step_is_learned_across_a_time_nothing_ran():
    now = [0.0]
    timer = StepTimer(lambda: now[0], StepTimeModel(per_token_doubt=1.0))
    timer.step_begins()
    timer.step_planned(10)
    now[0] += 5.0  # the step ran, then the engine idled: nothing was running
    timer.step_begins(learn=False)
    assert timer.model.num_observed == 0


def test_the_timer_averages_the_steps_a_stream_runs_alone():
    now = [0.0]
    timer = StepTimer(lambda: now[0], StepTimeModel(per_token_doubt=1.0))
    for tokens, seconds in [(1, 0.010), (4, 0.020), (1, 0.012), (1, 0.010)]:
        timer.step_begins()
        timer.step_planned(tokens)
        now[0] += seconds
    timer.step_begins()
    assert timer.solo_s == pytest.approx(0.010 + 0.1 * (0.012 - 0.010) + 0.1 * (0.010 - 0.0102))


def run_burst(burst: int, max_wait_s: float | None, num_steps: int = 40):
    """20 long decodes fill the seats a 50 ms target gives; then ``burst``
    requests arrive at once. Returns how many run after each later step."""
    clock = SteppedClock()
    scheduler = make_scheduler(max_num_seqs=64, max_num_batched_tokens=512, num_blocks=2000,
                               step_time_target_s=0.05, step_time_max_wait_s=max_wait_s, clock=clock)
    runner = ModelRunnerSim(4)
    for i in range(20):
        scheduler.add_request(make_request(f"long{i}", 6, max_tokens=1000))
    for _ in range(6 * MIN_STEPS_TIMED):
        output, _ = step(scheduler, runner)
        clock.run(output.total_num_scheduled_tokens)
    # 4 from a cold start, then 8, 16 and 20 as the model timed the steps.
    assert scheduler.running_seats() == 20 == len(scheduler.running)
    arrived = clock.now
    for i in range(burst):
        scheduler.add_request(make_request(f"burst{i}", 6, max_tokens=1000, arrival_time=arrived))
    running = []
    for _ in range(num_steps):
        output, _ = step(scheduler, runner)
        clock.run(output.total_num_scheduled_tokens)
        running.append((clock.now - arrived, len(scheduler.running)))
    return running


def test_a_short_burst_runs_past_the_bound_once_it_waited():
    # 3 waiting, at most a quarter of the ~20 seats: a burst. Each waits 0.5 s, then all run.
    running = run_burst(3, 0.5)
    assert all(n == 20 for waited, n in running if waited < 0.5)
    assert running[-1][1] == 23
    assert all(n == 23 for waited, n in running if waited >= 0.5 + 0.06)  # the next step after 0.5 s


def test_without_a_wait_a_burst_waits_for_seats():
    assert {n for _, n in run_burst(3, None)} == {20}


def test_a_long_queue_is_held_by_the_bound_however_long_it_waits():
    # 8 waiting: more than a quarter of the seats, sustained load, not a burst.
    running = run_burst(8, 0.5)
    assert running[-1][0] > 1.5 and {n for _, n in running} == {20}


def test_the_target_is_checked():
    with pytest.raises(ValueError, match="step_time_target_s"):
        SchedulerConfig(step_time_target_s=-0.01)
    with pytest.raises(ValueError, match="step_time_max_wait_s"):
        SchedulerConfig(step_time_target_s=0.05, step_time_max_wait_s=-1)
    with pytest.raises(ValueError, match="step_time_max_wait_s: .*needs step_time_target_s"):
        SchedulerConfig(step_time_max_wait_s=0.5)
    with pytest.raises(ValueError, match="step_time_target_solo_steps: .*needs step_time_target_s"):
        SchedulerConfig(step_time_target_solo_steps=7)
    with pytest.raises(ValueError, match="step_time_target_solo_steps"):
        SchedulerConfig(step_time_target_s=0.05, step_time_target_solo_steps=-1)


def test_the_timer_learns_steps_and_skips_idle_gaps():
    now = [0.0]
    timer = StepTimer(lambda: now[0], StepTimeModel(per_token_doubt=1.0))
    for tokens in [10, 40, 20, 80, 5, 60, 30, 70] * 3:
        timer.step_begins()
        timer.step_planned(tokens)
        now[0] += BASE_S + PER_TOKEN_S * tokens
    timer.step_begins()
    timer.step_planned(10)
    now[0] += 100.0  # the engine idled
    timer.step_begins()
    assert timer.model.predict(50) == pytest.approx(BASE_S + PER_TOKEN_S * 50, rel=0.02)
