"""bench/serve_vs_llama_server.py (issue 37), its pure parts: aiperf's export read
into the figures, the SLO, the search for the sustained rate, the requests
both servers get and their command lines. No server, no aiperf: the export is
a real one (aiperf 0.13.0, llama-server, 8 requests at 2/s), trimmed."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench"
EXPORT = Path(__file__).parent / "data" / "aiperf_profile_export.json"


@pytest.fixture(scope="module")
def bench():
    """The bench scripts import each other by name, as they do when run."""
    sys.path.insert(0, str(BENCH))
    try:
        yield {name: importlib.import_module(name)
               for name in ("serve_sweep", "peer_servers", "serve_vs_llama_server")}
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def sweep(bench):
    return bench["serve_sweep"]


def result(sweep, rate, ttft_p99_ms=100.0, tpot_p99_ms=20.0, num_ok=8, num_errors=0):
    return sweep.RateResult(rate=rate, num_ok=num_ok, num_errors=num_errors, output_tok_s=100.0,
                            request_s=rate, ttft_p50_ms=50.0, ttft_p99_ms=ttft_p99_ms, tpot_p50_ms=10.0,
                            tpot_p99_ms=tpot_p99_ms, mean_output_tokens=32.0)


# ==================================================================== the export


def test_export_read_into_the_figures(sweep):
    figures = sweep.parse_aiperf_export(EXPORT, rate=2.0)
    assert (figures.rate, figures.num_ok, figures.num_errors) == (2.0, 8, 0)
    assert figures.output_tok_s == pytest.approx(56.6078, rel=1e-4)
    assert figures.request_s == pytest.approx(1.769, rel=1e-3)
    assert (figures.ttft_p50_ms, figures.ttft_p99_ms) == pytest.approx((33.931, 265.381), rel=1e-4)
    assert (figures.tpot_p50_ms, figures.tpot_p99_ms) == pytest.approx((5.6208, 18.5512), rel=1e-4)
    assert figures.mean_output_tokens == 32.0


def test_export_units_and_missing_figures(sweep, tmp_path):
    data = json.loads(EXPORT.read_text())
    data["time_to_first_token"] = {**data["time_to_first_token"], "unit": "s", "p99": 2.5}
    data["error_request_count"] = {"unit": "requests", "avg": 3.0}
    del data["inter_token_latency"]  # no request streamed two tokens
    path = tmp_path / "export.json"
    path.write_text(json.dumps(data))
    figures = sweep.parse_aiperf_export(path, rate=16.0)
    assert figures.ttft_p99_ms == 2500.0 and figures.num_errors == 3
    assert math.isnan(figures.tpot_p50_ms) and math.isnan(figures.tpot_p99_ms)
    assert not sweep.meets_slo(figures, sweep.SLO(ttft_p99_ms=1e9, tpot_p99_ms=1e9), num_sent=8)


# ==================================================================== the SLO


def test_slo_bounds_both_p99s_and_needs_every_request(sweep):
    slo = sweep.SLO()
    assert (slo.ttft_p99_ms, slo.tpot_p99_ms) == (2000.0, 100.0)
    assert sweep.meets_slo(result(sweep, 4, ttft_p99_ms=2000.0, tpot_p99_ms=100.0), slo, num_sent=8)
    assert not sweep.meets_slo(result(sweep, 4, ttft_p99_ms=2000.1), slo, num_sent=8)
    assert not sweep.meets_slo(result(sweep, 4, tpot_p99_ms=100.1), slo, num_sent=8)
    assert not sweep.meets_slo(result(sweep, 4, num_errors=1), slo, num_sent=8)
    assert not sweep.meets_slo(result(sweep, 4, num_ok=7), slo, num_sent=8)
    assert not sweep.meets_slo(sweep.failed_result(4, num_sent=8), sweep.SLO(1e9, 1e9), num_sent=8)


# ==================================================================== the search


class FakeServer:
    """p99 TTFT grows with the rate and passes the SLO up to ``capacity`` req/s."""

    def __init__(self, sweep, capacity: float) -> None:
        self.sweep, self.capacity, self.measured = sweep, capacity, []

    def measure(self, rate: float):
        self.measured.append(rate)
        return result(self.sweep, rate, ttft_p99_ms=2000.0 * rate / self.capacity)

    def passes(self, figures) -> bool:
        return self.sweep.meets_slo(figures, self.sweep.SLO(), num_sent=8)


def known_rates(server: FakeServer, rates):
    known = {rate: server.measure(rate) for rate in rates}
    server.measured.clear()
    return known


def test_bracket(sweep):
    assert sweep.sustained_bracket({1: True, 2: True, 4: False, 8: False}) == (2, 4)
    assert sweep.sustained_bracket({1: True, 2: True}) == (2, math.inf)
    assert sweep.sustained_bracket({1: False, 2: False}) == (0.0, 1)
    # Not monotonic: the highest pass below the lowest failure.
    assert sweep.sustained_bracket({1: True, 2: False, 4: True}) == (1, 2)


def test_bisection_between_the_fixed_rates(sweep):
    server = FakeServer(sweep, capacity=11.0)
    known = known_rates(server, (1, 2, 4, 8, 16))
    found = sweep.find_sustained_rate(server.measure, server.passes, known, max_probes=4, rel_tol=0.1)
    assert server.measured[0] == pytest.approx(math.sqrt(8 * 16), abs=1e-3)  # geometric midpoint
    assert len(server.measured) <= 4 and not set(server.measured) & {1, 2, 4, 8, 16}
    low, high = found.bracket
    assert low <= 11.0 < high and high / low <= 1.1
    assert found.sustained_rate == low and set(found.results) == {1, 2, 4, 8, 16, *server.measured}


def test_every_rate_passing_doubles_up_to_max_rate(sweep):
    server = FakeServer(sweep, capacity=1000.0)
    found = sweep.find_sustained_rate(server.measure, server.passes, known_rates(server, (1, 2)),
                                      max_probes=10, max_rate=16.0)
    assert server.measured == [4, 8, 16]
    assert found.sustained_rate == 16 and math.isinf(found.bracket[1])


def test_no_rate_passing_halves_down(sweep):
    server = FakeServer(sweep, capacity=0.3)
    found = sweep.find_sustained_rate(server.measure, server.passes, known_rates(server, (1, 2)),
                                      max_probes=3, rel_tol=0.1)
    assert server.measured[:2] == [0.5, 0.25]
    assert 0.0 < found.sustained_rate <= 0.3 < found.bracket[1]


def test_tables_and_json(sweep):
    found = sweep.Sweep(results={4.0: result(sweep, 4.0)}, sustained_rate=4.0, bracket=(4.0, math.inf))
    row = sweep.rate_row("cadence defaults", result(sweep, 4.0), 8, True,
                         {"server_cores": 1.5, "client_cores": 0.25, "other_cores": 0.0})
    assert row == ("| cadence defaults | 4 | 8/8 | 100 | 50 / 100 | 10 / 20 | ok | 1.50 / 0.25 / 0.00 |")
    assert row.count("|") == sweep.rate_table_header().splitlines()[0].count("|")
    assert "| 4 | none failed (a lower bound) | 1 |" in sweep.sustained_row("x", found)
    assert json.loads(json.dumps(sweep.to_jsonable(found)))["bracket"] == [4.0, None]


# ==================================================================== requests and servers


def test_both_servers_get_the_same_requests(bench):
    script = bench["serve_vs_llama_server"]
    messages = script.user_messages()
    chat = script.conversations("chat", 70)
    assert [turn[0]["content"] for turn in chat] == [messages[i % 64] for i in range(70)]
    shared = script.conversations("shared-system", 9)
    systems = [turn[0]["content"] for turn in shared]
    assert systems[:4] == systems[4:8] and len(set(systems)) == script.NUM_SYSTEM_PROMPTS
    assert all(len(s) > script.SYSTEM_PROMPT_CHARS for s in systems)
    body = script.chat_payload("m", chat[0], 128)
    assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == 128
    assert body["temperature"] == 0.0 and body["stream_options"] == {"include_usage": True}


def test_quick_fills_only_what_is_not_given(bench):
    script = bench["serve_vs_llama_server"]
    args = script.parse_args(["--quick", "--rates", "4"])
    assert args.rates == "4" and args.requests_per_rate == 8 and args.no_sweep
    assert args.models == "default" and args.servers == "cadence-defaults,llama-best"
    assert not script.parse_args([]).no_sweep


def test_server_command_lines(bench, tmp_path):
    servers = bench["peer_servers"]
    configs = servers.server_configs(num_cores=2)
    assert set(configs) == {"cadence-defaults", "cadence-best", "llama-defaults", "llama-best"}
    model, template = tmp_path / "m.gguf", tmp_path / "t.jinja"
    cadence = servers.cadence_argv(model, 8123, configs["cadence-defaults"], None)
    assert cadence[1:5] == ["-m", "cadence.server", "serve", str(model)] and "--num-threads" not in cadence
    best = servers.cadence_argv(model, 8123, configs["cadence-best"], template)
    assert best[-4:] == ["--chat-template", str(template), "--num-threads", "2"]
    plain = servers.llama_server_argv(Path("llama-server"), model, 8124, configs["llama-defaults"], None)
    assert plain == ["llama-server", "-m", str(model), "--host", "127.0.0.1", "--port", "8124"]
    tuned = servers.llama_server_argv(Path("llama-server"), model, 8124, configs["llama-best"], template)
    assert tuned[tuned.index("-np") + 1] == "16" and tuned[tuned.index("-t") + 1] == "2"
    assert tuned[tuned.index("--chat-template-file") + 1] == str(template)
    capped = servers.config_named("cadence:--max-num-seqs 16", configs)
    assert servers.cadence_argv(model, 8123, capped, None)[-2:] == ["--max-num-seqs", "16"]
    assert servers.config_named("llama-best", configs) is configs["llama-best"]
    with pytest.raises(ValueError, match="^--servers: 'llama:-np 4' is neither"):
        servers.config_named("llama:-np 4", configs)


def test_a_server_that_cannot_start_is_a_failed_point(bench, tmp_path):
    script, servers, sweep = bench["serve_vs_llama_server"], bench["peer_servers"], bench["serve_sweep"]
    sitting = script.Sitting(
        models=[], configs=[], scenarios=["chat"], rates=[1.0], num_requests=4, output_tokens=8, cores=[0],
        sweep=False, max_probes=0, quiet_wait_s=0.0, max_other_cores=0.25, reruns=2, slo=sweep.SLO(),
        work_dir=tmp_path,
        llama_server=tmp_path / "no-such-llama-server", aiperf=tmp_path / "no-such-aiperf")
    model = script.Model("m", tmp_path / "m.gguf", None)
    point = script.measure_point(sitting, model, servers.server_configs(1)["llama-defaults"], "chat", 1.0)
    assert not point.ok and point.cpu is None and "FileNotFoundError" in point.error
    assert point.result.num_ok == 0 and point.result.num_errors == 4
