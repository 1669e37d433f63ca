#!/usr/bin/env python3
"""The serving bound's burst rule in the simulator, over many seeds (issue 37).

``cadence serve`` bounds its running batch by predicted step time (45 ms, or
6 single-stream steps) and lets a request past the bound once it waited
0.5 s while at most a quarter of the seats' worth of requests wait
(``Scheduler._burst_admits``). A sitting of 32 requests per rate is one
draw of Poisson bursts; this replays the same engine loop (the real
scheduler and its step-time fit, on the virtual clock) over many draws, on
step costs measured on two CPUs, for the rule of today and for others
patched in here:

- ``today``: the rule as it is.
- ``stretch:S:Q``: a waiting request that waited 0.5 s runs past the bound
  while at most Q x the seats wait, and a step of the running batch stays
  within S x the target.
- ``load:S``: the same ceiling, and no queue share: instead the load that
  arrives (arrivals over 30 s x their mean output) must be under what the
  seats decode (seats / predicted step), so a queue that bursts made drains
  and one that sustained load made is held.

Cost curves (``--curve``): a decode step's time by the number of streams
(bench/decode_batch_steps.py; avx2-*: the AVX2-only EPYC, 2026-11-28;
zen5-default: the Zen 5, quant-direct-rows-v1), plus ``--prompt-s`` a
prompt token, times ``--scale`` (1.2: what aiperf's share of the two cores
and the server's front end cost; with it the rule of today reproduced the
AVX2 sittings of 2026-11-28: TTFT and TPOT p50 at 4 and 8 req/s within 10%,
p99 TTFT at 1.3 req/s within 2%, at 1.4 req/s 4.6 s against 3.4), and each
step drawn within +-15% (a VM's drift).

Workloads: Poisson arrivals (``--requests`` per seed, prompts of 25-60
tokens, 128 output tokens, EOS ignored), or ``--schedule``: the arrival
times and prompt lengths of an aiperf run (its profile_export.jsonl; RATE
in the path is replaced by each rate), with the seeds drawing step costs
only. A 16-token warm-up request runs alone first, as the sitting's does.

    python bench/burst_rule_sim.py --curve avx2-default --rates 1.2,1.414,1.7 \\
        --rules today,stretch:1.3:0.5,stretch:1.5:0.5,load:1.5
    python bench/burst_rule_sim.py --curve zen5-default --rates 4,8 --requests 64

Figures: BENCHMARKS.md, serve-vs-llama-server-v1.
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import sys
from collections import deque
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cadence.config import CacheConfig, SchedulerConfig  # noqa: E402
from cadence.core.sched.scheduler import Scheduler  # noqa: E402
from cadence.sim.simulator import Simulator  # noqa: E402
from cadence.sim.workload import RequestSpec  # noqa: E402

# (streams, seconds a decode step of that many) and a prompt token's seconds.
CURVES = {
    "avx2-default": ([(1, .0075), (8, .0304), (12, .0453), (16, .0571), (24, .0771), (32, .1007)], 0.0012),
    "avx2-gemma": ([(1, .0158), (8, .0563), (12, .0794), (16, .1081), (24, .1523), (32, .1935)], 0.0015),
    "zen5-default": ([(1, .0049), (4, .0097), (8, .0205), (12, .0285), (16, .0328), (64, .058)], 0.0006),
}
# The serving defaults (cadence/server/cli.py) and the SLO of the sitting.
TARGET_S, SOLO_STEPS, MAX_WAIT_S = 0.045, 6.0, 0.5
SLO_TTFT_S, SLO_TPOT_S = 2.0, 0.1
WARMUP = RequestSpec(0.0, 20, 16)
FIRST_ARRIVAL_S = 3.0
LOAD_WINDOW_S = 30.0
LOAD_MIN_SPAN_S = 5.0


class CurveCost:
    """A step's seconds: the decode curve at its number of sequences, plus its prompt tokens."""

    name = "decode-curve"

    def __init__(self, points: list[tuple[int, float]], prompt_s: float, scale: float, seed: int) -> None:
        last_n, last_s = points[-1]
        self.points = [(0, 0.0), *points, (last_n * 8, last_s * 8)]
        self.prompt_s, self.scale = prompt_s, scale
        self.rng = random.Random(seed)

    def step_seconds(self, shape) -> float:
        if not shape.num_tokens:
            return 0.0
        sizes = [n for n, _ in self.points]
        i = min(bisect.bisect_left(sizes, shape.num_seqs), len(sizes) - 1)
        (n0, s0), (n1, s1) = self.points[i - 1], self.points[i]
        decode_s = s0 + (s1 - s0) * (shape.num_seqs - n0) / (n1 - n0)
        prompt_s = self.prompt_s * (shape.num_tokens - shape.num_seqs)
        return self.scale * (decode_s + prompt_s) * self.rng.uniform(0.85, 1.15)

    def num_kv_blocks(self, block_size: int) -> int:
        return 4096

    def describe(self) -> dict:
        return {"name": self.name}


class LoadMeter:
    """Arrivals over the last LOAD_WINDOW_S times their mean max_tokens (once 8
    finished, their mean output where less): output tokens/s asked."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.arrivals: deque[tuple[float, int]] = deque()
        self.asked = 0
        self.num_finished = 0
        self.mean_output = 0.0

    def arrived(self, when: float, max_tokens: int) -> None:
        self.arrivals.append((when, max_tokens))
        self.asked += max_tokens

    def finished(self, num_output: int) -> None:
        self.num_finished += 1
        self.mean_output += max(0.1, 1.0 / self.num_finished) * (num_output - self.mean_output)

    def tokens_per_s(self) -> float:
        now = self.clock()
        while self.arrivals and self.arrivals[0][0] < now - LOAD_WINDOW_S:
            self.asked -= self.arrivals.popleft()[1]
        if not self.arrivals:
            return 0.0
        per_request = self.asked / len(self.arrivals)
        if self.num_finished >= 8:
            per_request = min(per_request, self.mean_output)
        return len(self.arrivals) * per_request / max(LOAD_MIN_SPAN_S, now - self.arrivals[0][0])


def seats_within(scheduler: Scheduler, stretch: float) -> int:
    """``running_seats`` for ``stretch`` times the target (today's seats at 1.0)."""
    seats = scheduler.running_seats()
    timer = scheduler._step_timer
    base_s, per_token_s = timer.model.theta
    if stretch == 1.0 or per_token_s <= 0 or timer.model.num_observed < 8:  # (MIN_STEPS_TIMED)
        return seats
    target_s = scheduler.step_time_target_s
    stream_s = timer.stream_step_s()
    if scheduler.step_time_target_solo_steps is not None and stream_s is not None:
        target_s = max(target_s, scheduler.step_time_target_solo_steps * stream_s)
    grown = max(4, 2 * timer.max_tokens_timed)
    return max(seats, min(scheduler.max_num_running_reqs, grown, int((stretch * target_s - base_s) / per_token_s)))


def waited(scheduler: Scheduler, request) -> bool:
    return scheduler._clock() - request.arrival_time >= scheduler.step_time_max_wait_s


def stretch_rule(stretch: float, queue_share: float):
    def burst_admits(self, request, seats):
        return (waited(self, request) and len(self.waiting) <= max(1, int(seats * queue_share))
                and len(self.running) < seats_within(self, stretch))
    return burst_admits


def load_rule(stretch: float):
    def burst_admits(self, request, seats):
        if not waited(self, request) or len(self.running) >= seats_within(self, stretch):
            return False
        return self._load_meter.tokens_per_s() < seats / self._step_timer.model.predict(seats)
    return burst_admits


@contextmanager
def rule_patched(rule: str):
    """``Scheduler`` with the burst rule ``rule`` for the duration."""
    kind, *args = rule.split(":")
    saved = {name: getattr(Scheduler, name) for name in ("_burst_admits", "add_request", "_free_request")}
    if kind == "stretch":
        Scheduler._burst_admits = stretch_rule(float(args[0]), float(args[1]))
    elif kind == "load":
        Scheduler._burst_admits = load_rule(float(args[0]))

        def add_request(self, request):
            if not hasattr(self, "_load_meter"):
                self._load_meter = LoadMeter(self._clock)
            self._load_meter.arrived(request.arrival_time, request.max_tokens or 0)
            saved["add_request"](self, request)

        def free_request(self, request):
            self._load_meter.finished(request.num_output_tokens)
            return saved["_free_request"](self, request)

        Scheduler.add_request, Scheduler._free_request = add_request, free_request
    elif kind != "today":
        raise ValueError(f"--rules: {rule!r} is not today, stretch:S:Q or load:S")
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(Scheduler, name, method)


def workload(rate: float, num_requests: int, seed: int, schedule: str | None) -> list[RequestSpec]:
    if schedule is not None:
        path = schedule.replace("RATE", f"{rate:g}")
        records = sorted((json.loads(line) for line in open(path)),
                         key=lambda r: r["metadata"]["request_start_ns"])
        start = records[0]["metadata"]["request_start_ns"]
        return [WARMUP] + [
            RequestSpec(FIRST_ARRIVAL_S + (r["metadata"]["request_start_ns"] - start) / 1e9,
                        int(r["metrics"]["usage_prompt_tokens"]["value"]), 128) for r in records]
    rng = random.Random(seed)
    specs, now = [WARMUP], FIRST_ARRIVAL_S
    for _ in range(num_requests):
        specs.append(RequestSpec(now, rng.randint(25, 60), 128))
        now += rng.expovariate(rate)
    return specs


def run_once(args: argparse.Namespace, rate: float, seed: int) -> tuple[float, float, float, float]:
    """p50 and p99 TTFT, p50 and p99 TPOT (seconds) of one draw, the warm-up left out."""
    points, prompt_s = CURVES[args.curve]
    config = SchedulerConfig(step_time_target_s=TARGET_S, step_time_target_solo_steps=SOLO_STEPS,
                             step_time_max_wait_s=MAX_WAIT_S)
    cost = CurveCost(points, args.prompt_s if args.prompt_s is not None else prompt_s, args.scale, seed + 1000)
    simulator = Simulator(config, CacheConfig(block_size=16, num_gpu_blocks=4096), cost)
    recorder = simulator.run(workload(rate, args.requests, seed, args.schedule)).recorder
    arrival, first, last, num = (np.asarray(values)[1:] for values in (
        recorder.arrival, recorder.first_token, recorder.last_token, recorder.num_output))
    ttft, tpot = first - arrival, (last - first) / (num - 1)
    return (float(np.percentile(ttft, 50)), float(np.percentile(ttft, 99)),
            float(np.percentile(tpot, 50)), float(np.percentile(tpot, 99)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--curve", choices=sorted(CURVES), default="avx2-default")
    parser.add_argument("--rates", default="1.2,1.414,1.7,2,4,8")
    parser.add_argument("--rules", default="today,stretch:1.3:0.5,stretch:1.4:0.5,stretch:1.5:0.5,load:1.5")
    parser.add_argument("--requests", type=int, default=32, help="Poisson arrivals per seed")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--scale", type=float, default=1.2)
    parser.add_argument("--prompt-s", type=float, default=None, help="a prompt token's seconds (default: the curve's)")
    parser.add_argument("--schedule", default=None, help="an aiperf profile_export.jsonl; RATE: each rate")
    args = parser.parse_args()
    print(f"curve {args.curve} x {args.scale}, {args.seeds} seeds, "
          + (f"schedule {args.schedule}" if args.schedule else f"{args.requests} Poisson requests"))
    print("| rate | rule | SLO met | TTFT p50 / p99 ms | TPOT p50 / p99 ms |")
    print("|---:|---|---:|---:|---:|")
    for rate in (float(r) for r in args.rates.split(",")):
        for rule in args.rules.split(","):
            with rule_patched(rule):
                draws = np.array([run_once(args, rate, seed) for seed in range(args.seeds)])
            met = np.mean((draws[:, 1] <= SLO_TTFT_S) & (draws[:, 3] <= SLO_TPOT_S))
            median = np.median(draws, axis=0) * 1e3
            print(f"| {rate:g} | {rule} | {met:.0%} | {median[0]:,.0f} / {median[1]:,.0f} "
                  f"| {median[2]:.1f} / {median[3]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
