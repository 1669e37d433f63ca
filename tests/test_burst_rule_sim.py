"""bench/burst_rule_sim.py (issue 37): the rules it patches into the scheduler
change what a burst meets, and leave the scheduler as it was afterwards."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import pytest

from cadence.core.sched.scheduler import Scheduler

BENCH = Path(__file__).parents[1] / "bench"


@pytest.fixture(scope="module")
def study():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("burst_rule_sim")
    finally:
        sys.path.remove(str(BENCH))


def options(curve: str = "avx2-default", requests: int = 48) -> argparse.Namespace:
    return argparse.Namespace(curve=curve, requests=requests, scale=1.2, prompt_s=None, schedule=None)


def test_each_rule_is_patched_in_and_taken_out(study):
    methods = {name: getattr(Scheduler, name) for name in ("_burst_admits", "add_request", "_free_request")}
    for rule in ("today", "stretch:1.5:0.5", "load:1.5"):
        with study.rule_patched(rule):
            if rule == "today":
                assert Scheduler._burst_admits is methods["_burst_admits"]
            else:
                assert Scheduler._burst_admits is not methods["_burst_admits"]
        assert {name: getattr(Scheduler, name) for name in methods} == methods
    with pytest.raises(ValueError, match="--rules"):
        with study.rule_patched("wider"):
            pass


def test_a_stretch_trades_a_bursts_wait_for_its_streams_pace(study):
    # At 1.8 req/s on the AVX2 curve (about what the bound's ~13 seats
    # decode), Poisson bursts queue behind the seats under today's rule.
    args = options()
    with study.rule_patched("today"):
        today = [study.run_once(args, 1.8, seed) for seed in range(4)]
    with study.rule_patched("stretch:1.5:0.5"):
        stretched = [study.run_once(args, 1.8, seed) for seed in range(4)]
    worst_wait = max(draw[1] for draw in today)
    assert worst_wait > 2.0  # p99 TTFT, seconds: past the SLO
    assert max(draw[1] for draw in stretched) < worst_wait / 2
    assert sum(draw[2] for draw in stretched) > sum(draw[2] for draw in today)  # TPOT p50
    for ttft_p50, ttft_p99, tpot_p50, tpot_p99 in today + stretched:
        assert 0 < ttft_p50 <= ttft_p99 and 0 < tpot_p50 <= tpot_p99 < 0.2


def test_a_schedule_replays_arrivals_and_prompt_lengths(study, tmp_path):
    records = [
        '{"metadata": {"request_start_ns": %d}, "metrics": {"usage_prompt_tokens": {"value": %d}}}' % (t, n)
        for t, n in ((5_000_000_000, 30), (5_500_000_000, 41), (7_000_000_000, 52))
    ]
    (tmp_path / "rate-2").mkdir()
    (tmp_path / "rate-2" / "export.jsonl").write_text("\n".join(records[::-1]) + "\n")
    specs = study.workload(2.0, 99, 0, str(tmp_path / "rate-RATE" / "export.jsonl"))
    assert specs[0] == study.WARMUP
    start = study.FIRST_ARRIVAL_S
    assert [(s.arrival_time, s.prompt_tokens, s.output_tokens) for s in specs[1:]] == [
        (start, 30, 128), (start + 0.5, 41, 128), (start + 2.0, 52, 128)]
