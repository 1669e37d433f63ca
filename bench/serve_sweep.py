"""The pure half of ``serve_vs_llama_server.py``: one rate's figures read from
aiperf's export, the SLO they are judged by, the search for the highest rate
a server sustains within it, and the markdown tables.

No servers, no processes, no third-party imports: the tests drive it with a
fixture export and a fake ``measure``.

The sustained rate, as a search over one server's latency-versus-rate curve
(the SLO is assumed to hold below some rate and fail above it)::

    fixed rates      1     2     4     8    16
    SLO              ok    ok    ok    ok   fail     -> bracket (8, 16)
    probes           sqrt(8*16)=11.3 ok -> (11.3, 16); 13.5 fail -> (11.3, 13.5) ...

Midpoints are geometric (rates span orders of magnitude); the search stops
when the bracket's ratio is under ``1 + rel_tol`` or after ``max_probes``
measurements. When every known rate passes, the top rate is doubled until
one fails (at most ``max_rate``); when none passes, the bracket is
(0, the lowest rate) and the probes halve it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

# aiperf's metric tags (its JSON export keys)
TTFT = "time_to_first_token"
TPOT = "inter_token_latency"  # (latency - TTFT) / (output tokens - 1), per request
OUTPUT_TOK_S = "output_token_throughput"
REQUEST_S = "request_throughput"
NUM_OK = "request_count"
NUM_ERRORS = "error_request_count"
OUTPUT_TOKENS = "output_sequence_length"  # per request; the servers' usage with --use-server-token-count
MS_PER_UNIT = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3, "sec": 1e3}


@dataclass(frozen=True)
class SLO:
    """What a rate must meet to count as sustained (the issue's, for every model)."""

    ttft_p99_ms: float = 2000.0
    tpot_p99_ms: float = 100.0


@dataclass(frozen=True)
class RateResult:
    """One server at one request rate, as the load client measured it."""

    rate: float
    num_ok: int
    num_errors: int
    output_tok_s: float
    request_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    mean_output_tokens: float


@dataclass
class Sweep:
    """Every rate measured for one server, and the highest that met the SLO (0: none)."""

    results: dict[float, RateResult] = field(default_factory=dict)
    sustained_rate: float = 0.0
    bracket: tuple[float, float] = (0.0, math.inf)


# ==================================================================== aiperf's export


def parse_aiperf_export(path: Path | str, rate: float) -> RateResult:
    """The figures of ``profile_export_aiperf.json`` (aiperf's summary export)."""
    data = json.loads(Path(path).read_text())
    return RateResult(
        rate=rate,
        num_ok=int(_stat(data, NUM_OK, "avg", default=0.0)),
        num_errors=int(_stat(data, NUM_ERRORS, "avg", default=0.0)),
        output_tok_s=_stat(data, OUTPUT_TOK_S, "avg"),
        request_s=_stat(data, REQUEST_S, "avg"),
        ttft_p50_ms=_ms(data, TTFT, "p50"),
        ttft_p99_ms=_ms(data, TTFT, "p99"),
        tpot_p50_ms=_ms(data, TPOT, "p50"),
        tpot_p99_ms=_ms(data, TPOT, "p99"),
        mean_output_tokens=_stat(data, OUTPUT_TOKENS, "avg"),
    )


def failed_result(rate: float, num_sent: int) -> RateResult:
    """A point with no figures: the server or the client failed (it misses any SLO)."""
    nan = math.nan
    return RateResult(rate, 0, num_sent, nan, nan, nan, nan, nan, nan, nan)


def _stat(data: dict, tag: str, stat: str, default: float = math.nan) -> float:
    """One statistic of one metric; ``default`` where aiperf left it out (no such
    record: e.g. no error, or no streamed token)."""
    value = (data.get(tag) or {}).get(stat)
    return default if value is None else float(value)


def _ms(data: dict, tag: str, stat: str) -> float:
    unit = (data.get(tag) or {}).get("unit", "ms")
    return _stat(data, tag, stat) * MS_PER_UNIT[unit]


# ==================================================================== the SLO


def meets_slo(result: RateResult, slo: SLO, num_sent: int) -> bool:
    """Every request answered, and p99 TTFT and p99 TPOT within the SLO (a
    figure aiperf could not compute is a failure, never a pass)."""
    if result.num_errors or result.num_ok < num_sent:
        return False
    return result.ttft_p99_ms <= slo.ttft_p99_ms and result.tpot_p99_ms <= slo.tpot_p99_ms


# ==================================================================== the search


def sustained_bracket(passed: dict[float, bool]) -> tuple[float, float]:
    """(highest passing rate below the lowest failing one, that failing rate);
    0 and inf stand for "none"."""
    failing = [rate for rate, ok in passed.items() if not ok]
    high = min(failing, default=math.inf)
    low = max((rate for rate, ok in passed.items() if ok and rate < high), default=0.0)
    return low, high


def next_probe(low: float, high: float, max_rate: float) -> float | None:
    """The rate to measure next, or None when the bracket cannot be narrowed
    (no failing rate found up to ``max_rate``)."""
    if math.isinf(high):
        return None if low >= max_rate else min(max_rate, 2 * low)
    if low == 0.0:
        return high / 2
    return math.sqrt(low * high)


def find_sustained_rate(measure: Callable[[float], RateResult], passes: Callable[[RateResult], bool],
                        known: dict[float, RateResult], *, max_probes: int = 4, rel_tol: float = 0.1,
                        max_rate: float = 64.0, min_rate: float = 0.125) -> Sweep:
    """Bisect between the known results for the highest rate ``passes`` accepts.

    ``measure(rate)`` runs one more point; ``known`` are the fixed rates
    already run (not measured again). Returns every result and the answer.
    """
    sweep = Sweep(results=dict(known))
    passed = {rate: passes(result) for rate, result in known.items()}
    for _ in range(max_probes):
        low, high = sustained_bracket(passed)
        if high <= min_rate or (low > 0.0 and high / low <= 1.0 + rel_tol):
            break
        rate = next_probe(low, high, max_rate)
        if rate is None:
            break
        rate = round(rate, 3)
        sweep.results[rate] = measure(rate)
        passed[rate] = passes(sweep.results[rate])
    sweep.bracket = sustained_bracket(passed)
    sweep.sustained_rate = sweep.bracket[0]
    return sweep


# ==================================================================== tables


RATE_COLUMNS = ("rate req/s", "ok/sent", "output tok/s", "TTFT p50 / p99 ms", "TPOT p50 / p99 ms", "SLO",
                "cores: server / client / other")


def rate_row(label: str, result: RateResult, num_sent: int, ok: bool, cpu: dict | None = None) -> str:
    """One table row; ``cpu``: the cores server, client and others kept busy meanwhile."""
    cores = ("n/a" if cpu is None else
             " / ".join(f"{cpu[key]:.2f}" for key in ("server_cores", "client_cores", "other_cores")))
    cells = (label, _num(result.rate), f"{result.num_ok}/{num_sent}", _num(result.output_tok_s),
             f"{_num(result.ttft_p50_ms)} / {_num(result.ttft_p99_ms)}",
             f"{_num(result.tpot_p50_ms)} / {_num(result.tpot_p99_ms)}", "ok" if ok else "miss", cores)
    return "| " + " | ".join(cells) + " |"


def rate_table_header() -> str:
    columns = ("server",) + RATE_COLUMNS
    return "| " + " | ".join(columns) + " |\n|---|" + "---:|" * 5 + "---|---:|"


def sustained_row(label: str, sweep: Sweep) -> str:
    low, high = sweep.bracket
    above = "none failed (a lower bound)" if math.isinf(high) else f"fails at {_num(high)}"
    return f"| {label} | {_num(sweep.sustained_rate)} | {above} | {len(sweep.results)} |"


def sustained_table_header(slo: SLO) -> str:
    return (f"| server | sustained req/s (p99 TTFT <= {_num(slo.ttft_p99_ms)} ms, p99 TPOT <= "
            f"{_num(slo.tpot_p99_ms)} ms) | above it | rates run |\n|---|---:|---|---:|")


def _num(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    if value >= 100 or value == int(value):
        return f"{value:,.0f}"
    return f"{value:.3g}" if value < 1 else f"{value:.1f}"


def to_jsonable(sweep: Sweep) -> dict:
    low, high = sweep.bracket
    return {"sustained_rate": sweep.sustained_rate, "bracket": [low, None if math.isinf(high) else high],
            "results": {str(rate): asdict(result) for rate, result in sorted(sweep.results.items())}}
