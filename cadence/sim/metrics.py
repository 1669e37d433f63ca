"""Serving metrics from a timeline of step outputs.

``MetricsRecorder`` is fed by whatever drives the engine (the virtual-clock
simulator or a wall-clock replay on the real model), identically:

    on_arrival(index, req_id, time)        when a request is added
    on_reject(index)                       when its prompt does not fit the context
    on_step(time, outputs)                 after a step, at the time its tokens exist
    on_queues(time, running, waiting, kv)  the scheduler's state after the step

Per request (times in seconds from the run's start):

    TTFT = first token - arrival          E2E = last token - arrival
    TPOT = (last token - first token) / (output tokens - 1)
    ITL  = gap between consecutive tokens of one request (all gaps, pooled)

Throughput is output tokens over the makespan (first arrival to last
token); goodput counts only requests meeting both SLOs.
"""

from __future__ import annotations

import math

from array import array
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from cadence.core.outputs import EngineCoreOutputs
from cadence.sim.workload import RequestSpec

PERCENTILES = (50, 90, 95, 99)
SERVICE_WINDOW_S = 1.0  # the service buckets Jain's fairness index is built from
STEPS_PER_JAIN_WINDOW = 20  # a window holds at least this many steps (slow engines: longer windows)


@dataclass
class Timeline:
    """The scheduler's state after each step."""

    time: array = field(default_factory=lambda: array("d"))
    running: array = field(default_factory=lambda: array("l"))
    waiting: array = field(default_factory=lambda: array("l"))
    kv_usage: array = field(default_factory=lambda: array("d"))


class MetricsRecorder:
    """Token times per request, gathered as the outputs arrive."""

    def __init__(self, specs: Sequence[RequestSpec]) -> None:
        n = len(specs)
        self.specs = specs
        self.arrival = [s.arrival_time for s in specs]
        self.first_token = [float("nan")] * n
        self.last_token = [float("nan")] * n
        self.num_output = [0] * n
        self.num_cached = [0] * n
        self.finished = [False] * n
        self.rejected = [False] * n  # prompt longer than the context: never added
        self._clients = [s.client for s in specs]
        self.itl = array("d")
        self.timeline = Timeline()
        # Tokens served per client in each SERVICE_WINDOW_S window: {window: {client: tokens}}
        # (a request's prompt counts when its first token comes).
        self.service: dict[int, dict[int, int]] = {}
        # req_id -> index, for requests still running.
        self._live: dict[str, int] = {}

    def on_arrival(self, index: int, req_id: str, time: float) -> None:
        self.arrival[index] = time
        self._live[req_id] = index

    def on_reject(self, index: int) -> None:
        self.rejected[index] = True

    def on_step(self, time: float, outputs: dict[int, EngineCoreOutputs]) -> None:
        live, first, last, num_output = self._live, self.first_token, self.last_token, self.num_output
        clients = self._clients
        gaps: list[float] = []  # this step's inter-token gaps, in order (one call into the array)
        # Tokens served to one client by consecutive outputs, added to the
        # step's service bucket when the client changes (most steps: once).
        run_client, run_served = 0, 0
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                i = live[out.request_id]
                num_new = len(out.new_token_ids)
                if num_new:
                    served = num_new
                    if num_output[i]:
                        gaps.append(time - last[i])
                    else:
                        first[i] = time
                        self.num_cached[i] = out.num_cached_tokens
                        served += self.specs[i].prompt_tokens
                    client = clients[i]
                    if client != run_client:
                        self._serve(time, run_client, run_served)
                        run_client, run_served = client, 0
                    run_served += served
                    if num_new > 1:  # several tokens in one step (drafts accepted)
                        gaps.extend([0.0] * (num_new - 1))
                    last[i] = time
                    num_output[i] += num_new
                if out.finish_reason is not None:
                    self.finished[i] = True
                    del live[out.request_id]
        self._serve(time, run_client, run_served)
        if gaps:
            self.itl.fromlist(gaps)

    def _serve(self, time: float, client: int, tokens: int) -> None:
        """Count ``tokens`` served to ``client`` in the service bucket of ``time``."""
        if tokens:
            window = self.service.setdefault(int(time / SERVICE_WINDOW_S), {})
            window[client] = window.get(client, 0) + tokens

    def on_queues(self, time: float, num_running: int, num_waiting: int, kv_usage: float) -> None:
        timeline = self.timeline
        timeline.time.append(time)
        timeline.running.append(num_running)
        timeline.waiting.append(num_waiting)
        timeline.kv_usage.append(kv_usage)


@dataclass(frozen=True)
class SLO:
    """Service-level objectives a request must meet to count in goodput."""

    ttft_s: float = 2.0
    tpot_s: float = 0.2


def distribution(values: Iterable[float]) -> dict[str, float | int]:
    """Count, mean, p50/p90/p95/p99 and max (linear-interpolated percentiles)."""
    import numpy as np

    a = np.asarray(values if isinstance(values, array) else list(values), dtype=float)
    a = a[~np.isnan(a)]
    if a.size == 0:
        return {"count": 0}
    result: dict[str, float | int] = {"count": int(a.size), "mean": float(a.mean())}
    for p, v in zip(PERCENTILES, np.percentile(a, PERCENTILES)):
        result[f"p{p}"] = float(v)
    result["max"] = float(a.max())
    return result


def jain_index(recorder: MetricsRecorder, client_weights: dict[int, float] | None = None) -> float | None:
    """Jain's index of weighted service over backlogged clients, averaged over windows.

    A window is ``SERVICE_WINDOW_S`` long, or ``STEPS_PER_JAIN_WINDOW``
    median steps where steps are slower (one step's prompt tokens would
    otherwise decide a window). In each, the clients with a request waiting
    for its first token at some point of it are backlogged; with two or more,
    ``J = (sum x)^2 / (n * sum x^2)`` of their tokens served in it divided by
    their weights (1 = perfectly fair shares, 1/n = one client takes all).
    None when no window has two backlogged clients.
    """
    import numpy as np

    weights = client_weights or {}
    steps = np.diff(np.asarray(recorder.timeline.time))
    median_step = float(np.median(steps)) if steps.size else 0.0
    span = max(1, math.ceil(STEPS_PER_JAIN_WINDOW * median_step / SERVICE_WINDOW_S))
    windows: dict[int, dict[int, int]] = {}
    for bucket, served in recorder.service.items():
        totals = windows.setdefault(bucket // span, {})
        for client, tokens in served.items():
            totals[client] = totals.get(client, 0) + tokens
    arrival = np.asarray(recorder.arrival)
    first = np.asarray(recorder.first_token)
    first = np.where(np.isnan(first), np.inf, first)
    clients = np.asarray([s.client for s in recorder.specs])
    served_mask = ~np.asarray(recorder.rejected, dtype=bool)
    indices = []
    for window, served in windows.items():
        start, end = window * span * SERVICE_WINDOW_S, (window + 1) * span * SERVICE_WINDOW_S
        waiting = served_mask & (arrival < end) & (first > start)
        backlogged = set(np.unique(clients[waiting]).tolist())
        if len(backlogged) < 2:
            continue
        x = np.array([served.get(c, 0) / weights.get(c, 1.0) for c in sorted(backlogged)])
        if x.sum() > 0:
            indices.append(float(x.sum() ** 2 / (len(x) * (x ** 2).sum())))
    return float(np.mean(indices)) if indices else None


def summarize(recorder: MetricsRecorder, slo: SLO = SLO(), num_preemptions: int | None = None,
              client_weights: dict[int, float] | None = None) -> dict[str, Any]:
    """The JSON summary of one run (``client_weights``: for Jain's index)."""
    import numpy as np

    specs = recorder.specs
    arrival = np.asarray(recorder.arrival)
    first = np.asarray(recorder.first_token)
    last = np.asarray(recorder.last_token)
    num_output = np.asarray(recorder.num_output)
    finished = np.asarray(recorder.finished, dtype=bool)
    rejected = np.asarray(recorder.rejected, dtype=bool)
    prompt = np.asarray([s.prompt_tokens for s in specs])
    ttft = first - arrival
    e2e = last - arrival
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(num_output > 1, (last - first) / (num_output - 1), np.nan)
    makespan = float(np.nanmax(last) - arrival.min()) if finished.any() else 0.0
    # Each request's own targets where it has them (interactive), else the run's.
    ttft_target = np.asarray([slo.ttft_s if s.slo_ttft_s is None else s.slo_ttft_s for s in specs])
    tpot_target = np.asarray([slo.tpot_s if s.slo_tpot_s is None else s.slo_tpot_s for s in specs])
    good = finished & (ttft <= ttft_target) & ~(tpot > tpot_target)  # a 1-token request has no TPOT
    total_output = int(num_output.sum())
    summary: dict[str, Any] = {
        "num_requests": len(specs),
        "num_finished": int(finished.sum()),
        "num_rejected": int(sum(recorder.rejected)),
        "makespan_s": makespan,
        "throughput": {
            "output_tokens_per_s": total_output / makespan if makespan else 0.0,
            "total_tokens_per_s": (total_output + int(prompt[finished].sum())) / makespan if makespan else 0.0,
            "requests_per_s": int(finished.sum()) / makespan if makespan else 0.0,
        },
        "goodput": {
            "slo_ttft_s": slo.ttft_s,
            "slo_tpot_s": slo.tpot_s,
            "requests_per_s": int(good.sum()) / makespan if makespan else 0.0,
            "fraction": float(good.mean()),
        },
        "ttft_s": distribution(ttft),
        "tpot_s": distribution(tpot),
        "itl_s": distribution(recorder.itl),
        "e2e_s": distribution(e2e),
        "output_tokens": total_output,
        "prompt_tokens": int(prompt.sum()),
        "prefix_hit_rate": float(sum(recorder.num_cached) / max(int(prompt[~rejected].sum()), 1)),
    }
    per_group = (ttft, tpot, e2e, num_output, good, makespan)
    summary["per_client"] = _per_group([s.client for s in specs], *per_group)
    summary["jain_index_backlogged"] = jain_index(recorder, client_weights)
    summary["per_priority"] = _per_group([s.priority for s in specs], *per_group)
    classes = [int(s.slo_ttft_s is not None or s.slo_tpot_s is not None) for s in specs]
    summary["per_class"] = {("interactive" if k == "1" else "batch"): v
                            for k, v in _per_group(classes, *per_group).items()}
    if num_preemptions is not None:
        summary["preemptions"] = num_preemptions
    return summary


def _per_group(keys: list[int], ttft, tpot, e2e, num_output, good, makespan) -> dict[str, Any]:
    """Service received by each client (or priority class)."""
    import numpy as np

    key_array = np.asarray(keys)
    total = max(int(num_output.sum()), 1)
    result = {}
    for key in np.unique(key_array):
        mask = key_array == key
        tokens = int(num_output[mask].sum())
        result[str(int(key))] = {
            "num_requests": int(mask.sum()),
            "output_tokens": tokens,
            "output_tokens_per_s": tokens / makespan if makespan else 0.0,
            "token_share": tokens / total,
            "ttft_p50_s": _nanpercentile(ttft[mask], 50),
            "ttft_p90_s": _nanpercentile(ttft[mask], 90),
            "ttft_p99_s": _nanpercentile(ttft[mask], 99),
            "tpot_p50_s": _nanpercentile(tpot[mask], 50),
            "e2e_p50_s": _nanpercentile(e2e[mask], 50),
            "slo_fraction": float(good[mask].mean()),
        }
    return result


def _nanpercentile(values, q: float) -> float | None:
    import numpy as np

    values = values[~np.isnan(values)]
    return float(np.percentile(values, q)) if values.size else None
