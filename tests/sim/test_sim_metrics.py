"""Metrics on a hand-made timeline."""

import pytest

from cadence.core.outputs import EngineCoreOutput, EngineCoreOutputs
from cadence.core.request import FinishReason
from cadence.sim.metrics import SLO, MetricsRecorder, distribution, summarize
from cadence.sim.workload import RequestSpec


def out(req_id, n=1, finish=False, cached=0):
    return EngineCoreOutput(req_id, [7] * n, FinishReason.LENGTH if finish else None, num_cached_tokens=cached)


def test_percentiles_on_a_hand_made_timeline():
    # Request 0 (client 0) arrives at 0: tokens at 1, 2, 4 -> TTFT 1, TPOT 1.5, ITLs 1, 2.
    # Request 1 (client 1) arrives at 1: tokens at 2, 3 -> TTFT 1, TPOT 1, ITL 1.
    # Request 2 (client 1) arrives at 2: one token at 7 -> TTFT 5, no TPOT.
    specs = [RequestSpec(0.0, 10, 3), RequestSpec(1.0, 20, 2, client=1), RequestSpec(2.0, 30, 1, client=1)]
    recorder = MetricsRecorder(specs)
    recorder.on_arrival(0, "a", 0.0)
    recorder.on_step(1.0, {0: EngineCoreOutputs([out("a", cached=4)])})
    recorder.on_arrival(1, "b", 1.0)
    recorder.on_step(2.0, {0: EngineCoreOutputs([out("a")]), 1: EngineCoreOutputs([out("b")])})
    recorder.on_arrival(2, "c", 2.0)
    recorder.on_step(3.0, {1: EngineCoreOutputs([out("b", finish=True)])})
    recorder.on_step(4.0, {0: EngineCoreOutputs([out("a", finish=True)])})
    recorder.on_step(7.0, {1: EngineCoreOutputs([out("c", finish=True, cached=16)])})
    summary = summarize(recorder, SLO(ttft_s=2.0, tpot_s=1.2), num_preemptions=3)

    assert summary["ttft_s"]["p50"] == 1.0 and summary["ttft_s"]["max"] == 5.0
    assert summary["ttft_s"]["mean"] == pytest.approx(7 / 3)
    assert summary["ttft_s"]["p90"] == pytest.approx(1 + 0.8 * 4)  # linear interpolation
    assert summary["tpot_s"]["count"] == 2 and summary["tpot_s"]["p50"] == pytest.approx(1.25)
    assert sorted(recorder.itl) == [1.0, 1.0, 2.0]
    assert summary["itl_s"]["p50"] == 1.0
    assert summary["e2e_s"]["p50"] == pytest.approx(4.0)  # e2e: 4, 2, 5
    assert summary["makespan_s"] == 7.0
    assert summary["throughput"]["output_tokens_per_s"] == pytest.approx(6 / 7)
    # Goodput: b meets both SLOs; a's TPOT (1.5) and c's TTFT (5) miss.
    assert summary["goodput"]["fraction"] == pytest.approx(1 / 3)
    assert summary["goodput"]["requests_per_s"] == pytest.approx(1 / 7)
    assert summary["prefix_hit_rate"] == pytest.approx(20 / 60)
    assert summary["preemptions"] == 3
    clients = summary["per_client"]
    assert clients["0"]["output_tokens"] == 3 and clients["1"]["output_tokens"] == 3
    assert clients["1"]["ttft_p50_s"] == pytest.approx(3.0) and clients["1"]["token_share"] == 0.5


def test_distribution_ignores_missing_values():
    assert distribution([float("nan"), 2.0, 4.0]) == {
        "count": 2, "mean": 3.0, "p50": 3.0, "p90": 3.8, "p95": 3.9, "p99": pytest.approx(3.98), "max": 4.0,
    }
    assert distribution([]) == {"count": 0}
