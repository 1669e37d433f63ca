"""``cadence simulate`` through its own parser (the lead wires it into cadence.cli)."""

import argparse
import json

import pytest

from cadence.sim.cli import add_simulate_parser


def parse(argv):
    parser = argparse.ArgumentParser(prog="cadence")
    add_simulate_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_run_is_the_default_action_and_compares_policies(tmp_path, capsys):
    out = tmp_path / "out"
    args = parse(["simulate", "--policy", "fcfs,priority", "--num-requests", "120", "--rate", "50",
                  "--priorities", "0,1", "--num-clients", "2", "--prefix-groups", "2",
                  "--max-num-seqs", "16", "--out", str(out), "--save-trace", str(tmp_path / "t.jsonl")])
    assert args.func(args) == 0
    table = capsys.readouterr().out
    assert "fcfs" in table and "priority" in table and "TTFT p50" in table
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["policies"]) == {"fcfs", "priority"}
    assert summary["cost_model"]["name"] == "roofline:h100"
    assert summary["scheduler"]["max_num_seqs"] == 16
    for name in ("ttft_cdf.png", "queues.png", "kv_usage.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    # The saved trace replays to the same figures.
    args = parse(["simulate", "run", "--trace", str(tmp_path / "t.jsonl"), "--policy", "fcfs",
                  "--max-num-seqs", "16", "--out", str(tmp_path / "again")])
    assert args.func(args) == 0
    again = json.loads((tmp_path / "again" / "summary.json").read_text())
    assert again["policies"]["fcfs"]["ttft_s"] == summary["policies"]["fcfs"]["ttft_s"]


def test_cost_model_and_model_config_options(capsys):
    args = parse(["simulate", "--cost-model", "roofline:cpu", "--model-config", "smollm2-135m",
                  "--num-requests", "20", "--rate", "1", "--prompt-len", "fixed:64", "--output-len", "fixed:8"])
    assert args.func(args) == 0
    assert "output tok/s" in capsys.readouterr().out
    args = parse(["simulate", "--cost-model", "roofline:tpu"])
    with pytest.raises(ValueError, match="cost_model"):
        args.func(args)


def test_calibrate_action_parses():
    args = parse(["simulate", "calibrate", "--out", "x.json", "--dtype", "float32", "--quick"])
    assert args.sim_action == "calibrate" and args.out == "x.json" and args.quick
    assert args.func.__name__ == "cmd_calibrate"


def test_building_the_parser_loads_neither_torch_nor_the_simulator():
    # cadence.cli builds every subcommand's parser for every command.
    import subprocess
    import sys

    script = (
        "import argparse, sys\n"
        "from cadence.sim.cli import add_simulate_parser\n"
        "add_simulate_parser(argparse.ArgumentParser().add_subparsers())\n"
        "print(sorted(m for m in ('torch', 'numpy', 'cadence.sim.simulator', 'cadence.engine') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("flags, field", [
    (["--enable-kv-cache-events"], "enable_kv_cache_events"),
])
def test_options_the_simulator_would_ignore_are_refused(flags, field):
    args = parse(["simulate", "--num-requests", "4", *flags])
    with pytest.raises(ValueError, match=f"^{field}: not supported yet"):
        args.func(args)


def test_the_roofline_prices_the_cache_dtype(tmp_path):
    """float16 and q8_0 caches are priced (q8_0: 34 bytes per 32 values, so more blocks)."""
    blocks = {}
    for dtype in ("float16", "q8_0"):
        out = tmp_path / dtype
        args = parse(["simulate", "--num-requests", "4", "--kv-cache-dtype", dtype, "--cost-model", "roofline:cpu",
                      "--model-config", "smollm2-135m", "--out", str(out)])
        assert args.func(args) == 0
        blocks[dtype] = json.loads((out / "summary.json").read_text())["cache"]["num_gpu_blocks"]
    assert blocks["q8_0"] == pytest.approx(blocks["float16"] * 2 / (34 / 32), rel=0.01)


def test_fair_policy_protects_the_light_client_in_the_simulator(tmp_path):
    """Two clients at 10:1 and past capacity: under fair the light one is served at once."""
    out = tmp_path / "fair"
    args = parse(["simulate", "--policy", "fcfs,fair", "--num-requests", "600", "--rate", "90",
                  "--client-shares", "10,1", "--fair-client-weights", "client0=1", "--seed", "1",
                  "--out", str(out)])
    assert args.func(args) == 0
    policies = json.loads((out / "summary.json").read_text())["policies"]
    fcfs, fair = policies["fcfs"]["per_client"], policies["fair"]["per_client"]
    assert fair["1"]["ttft_p90_s"] < fcfs["1"]["ttft_p90_s"] / 5
    assert (out / "ttft_cdf_per_client.png").read_bytes()[:4] == b"\x89PNG"
    assert fair["1"]["num_requests"] == fcfs["1"]["num_requests"]
    throughput = {p: policies[p]["throughput"]["output_tokens_per_s"] for p in ("fcfs", "fair")}
    assert throughput["fair"] >= 0.95 * throughput["fcfs"]


def test_fair_short_steps_cut_the_light_clients_wait(tmp_path):
    """The same trace with short steps off (the whole budget) and on (the default)."""
    light_p90 = {}
    for short in ("2048", None):
        out = tmp_path / f"short-{short}"
        flags = [] if short is None else ["--fair-short-step-tokens", short]
        args = parse(["simulate", "--policy", "fair", "--num-requests", "600", "--rate", "90",
                      "--client-shares", "10,1", "--seed", "1", "--out", str(out), *flags])
        assert args.func(args) == 0
        summary = json.loads((out / "summary.json").read_text())
        light_p90[short] = summary["policies"]["fair"]["per_client"]["1"]["ttft_p90_s"]
    assert light_p90[None] < 0.9 * light_p90["2048"]


def test_weighted_shares_give_a_fair_jain_index(tmp_path, capsys):
    """Both clients past capacity, client0 weighted 2: fair serves 2:1, FCFS 1:1."""
    out = tmp_path / "jain"
    args = parse(["simulate", "--policy", "fcfs,fair", "--num-requests", "1500", "--rate", "110",
                  "--client-shares", "1,1", "--fair-client-weights", "client0=2", "--seed", "1",
                  "--out", str(out)])
    assert args.func(args) == 0
    assert "Jain, backlogged" in capsys.readouterr().out
    policies = json.loads((out / "summary.json").read_text())["policies"]
    fcfs, fair = policies["fcfs"]["jain_index_backlogged"], policies["fair"]["jain_index_backlogged"]
    assert fair >= 0.95 and fair > fcfs


def test_slo_policy_raises_goodput_of_interactive_requests(tmp_path):
    """Interactive (TTFT 0.5 s, TPOT 50 ms) among batch requests at 1.2x capacity."""
    out = tmp_path / "slo"
    args = parse(["simulate", "--policy", "fcfs,slo", "--num-requests", "1500", "--rate", "64",
                  "--interactive-fraction", "0.3", "--interactive-slo", "0.5,0.05",
                  "--goodput-ttft-s", "1e6", "--goodput-tpot-s", "1e6", "--slo-reject", "--seed", "1",
                  "--out", str(out)])
    assert args.func(args) == 0
    policies = json.loads((out / "summary.json").read_text())["policies"]
    met = {p: policies[p]["per_class"]["interactive"]["slo_fraction"] for p in ("fcfs", "slo")}
    assert met["slo"] >= 0.9 and met["slo"] >= 1.5 * met["fcfs"]


def test_data_parallel_runs_compare_routing_policies(tmp_path, capsys):
    out = tmp_path / "out"
    args = parse(["simulate", "--data-parallel-size", "3", "--dp-routing", "round_robin,cache_aware",
                  "--num-requests", "90", "--rate", "60", "--prefix-groups", "6",
                  "--prefix-fraction", "1", "--prefix-tokens", "128", "--out", str(out)])
    assert args.func(args) == 0
    table = capsys.readouterr().out
    assert "round_robin" in table and "cache_aware" in table and "prefix hit rate" in table
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data_parallel_size"] == 3
    assert summary["policies"]["round_robin"]["requests_per_replica"] == [30, 30, 30]
    assert sum(summary["policies"]["cache_aware"]["requests_per_replica"]) == 90


def test_goodput_thresholds_are_their_own_options_not_the_slo_policys(tmp_path):
    """--goodput-*-s judge the run; --slo-*-s are the slo policy's targets (generated
    from SchedulerConfig). The old --slo-ttft / --slo-tpot are gone, not abbreviations."""
    from cadence.sim.cli import GoodputOptions
    from cadence.sim.metrics import SLO

    assert GoodputOptions().slo() == SLO()  # the defaults the library's summaries use
    out = tmp_path / "goodput"
    args = parse(["simulate", "--num-requests", "40", "--rate", "20", "--goodput-ttft-s", "1e-9",
                  "--out", str(out)])
    assert args.func(args) == 0
    goodput = json.loads((out / "summary.json").read_text())["policies"]["fcfs"]["goodput"]
    assert goodput["slo_ttft_s"] == 1e-9 and goodput["fraction"] == 0.0
    for old in ("--slo-ttft", "--slo-tpot"):
        with pytest.raises(SystemExit):
            parse(["simulate", old, "1"])
    args = parse(["simulate", "--num-requests", "4", "--goodput-tpot-s", "0"])
    with pytest.raises(ValueError, match="^goodput_tpot_s: must be > 0"):
        args.func(args)


@pytest.mark.parametrize("flags, field", [
    (["--data-parallel-size", "0"], "data_parallel_size"),
    (["--kv-offload-size", "0"], "kv_offload_size"),
])
def test_engine_options_are_the_generated_ones_checked_by_their_class(flags, field):
    from cadence.config import KVTransferConfig, ParallelConfig
    from cadence.config_cli import add_config_options

    def help_of(parser, flag):
        return next(a.help for a in parser._actions if flag in a.option_strings)

    engine = argparse.ArgumentParser()
    add_config_options(engine, (KVTransferConfig, ParallelConfig))
    simulate = add_simulate_parser(argparse.ArgumentParser().add_subparsers())
    assert help_of(simulate, flags[0]) == help_of(engine, flags[0])  # as cadence serve has it
    args = parse(["simulate", "--num-requests", "4", *flags])
    with pytest.raises(ValueError, match=f"^{field}: must be"):
        args.func(args)


@pytest.mark.parametrize("flags, field", [
    (["--dp-routing", "random"], "dp_routing"),
    (["--policy", "fcfs,priority"], "policy"),
    (["--dp-load-margin-tokens", "-1"], "dp_load_margin_tokens"),
])
def test_data_parallel_options_are_checked(flags, field):
    args = parse(["simulate", "--data-parallel-size", "2", "--num-requests", "4", *flags])
    with pytest.raises(ValueError, match=f"^{field}:"):
        args.func(args)


def test_prefill_decode_runs_data_parallel_replicas_then_each_link(tmp_path, capsys):
    out = tmp_path / "out"
    args = parse(["simulate", "--prefill-decode", "1,1", "--pd-link", "pcie,ethernet-100g",
                  "--dp-routing", "least_loaded", "--num-requests", "20", "--rate", "20",
                  "--prompt-len", "uniform:200:800", "--output-len", "uniform:4:32", "--out", str(out)])
    assert args.func(args) == 0
    table = capsys.readouterr().out
    assert "dp 2" in table and "pd 1P1D ethernet-100g" in table and "pulls (s on links)" in table
    summary = json.loads((out / "summary.json").read_text())
    assert summary["prefill_decode"] == "1,1"
    runs = summary["policies"]
    assert [runs[label]["num_finished"] for label in runs] == [20, 20, 20]
    pulls = [runs[f"pd 1P1D {link}"]["transfers"]["seconds"] for link in ("pcie", "ethernet-100g")]
    assert pulls[1] == pytest.approx(pulls[0] * 32 / 12.5)


@pytest.mark.parametrize("flags, field", [
    (["--prefill-decode", "2"], "prefill_decode"),
    (["--prefill-decode", "1,0"], "prefill_decode"),
    (["--prefill-decode", "1,1", "--pd-link", "pcie,smoke-signals"], "pd_link"),
    (["--prefill-decode", "1,1", "--pd-transfer-latency", "-1"], "pd_transfer_latency"),
    (["--prefill-decode", "1,1", "--dp-routing", "round_robin,cache_aware"], "dp_routing"),
    (["--prefill-decode", "1,1", "--dp-routing", "random"], "dp_routing"),
    (["--prefill-decode", "1,1", "--data-parallel-size", "2"], "prefill_decode"),
])
def test_prefill_decode_options_are_checked(flags, field):
    args = parse(["simulate", "--num-requests", "4", *flags])
    with pytest.raises(ValueError, match=f"^{field}:"):
        args.func(args)
