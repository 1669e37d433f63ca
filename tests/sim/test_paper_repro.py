"""bench/paper_repro.py (issue 36 item 4): the A100 roofline's numbers, and the
script's setting built and run small (not the sweep)."""

import importlib.util
import sys
from pathlib import Path

import pytest

from cadence.sim.cost_model import PROFILES, StepShape, make_cost_model

SCRIPT = Path(__file__).parents[2] / "bench" / "paper_repro.py"


@pytest.fixture(scope="module")
def repro():
    spec = importlib.util.spec_from_file_location("paper_repro", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a100_profile_numbers():
    a100, h100 = PROFILES["a100"], PROFILES["h100"]
    assert (a100.peak_flops, a100.mem_bandwidth, a100.mem_capacity) == (312e12, 2.0e12, 80e9)
    # The H100's efficiencies and per-step overhead, unchanged.
    assert (a100.compute_efficiency, a100.memory_efficiency, a100.step_overhead_s) == (
        h100.compute_efficiency, h100.memory_efficiency, h100.step_overhead_s)


def test_a100_roofline_step_time(repro):
    model = make_cost_model("roofline:a100", str(repro.MODEL_CONFIG))
    params = model.model.num_params
    # One decode: memory-bound, the weights once at 80% of 2.0 TB/s.
    decode = StepShape(num_tokens=1, num_seqs=1, num_kv_tokens=1, num_attn_pairs=1)
    expected = (params * 2 + model.kv_bytes_per_token) / (2.0e12 * 0.8) + 0.0005
    assert model.step_seconds(decode) == pytest.approx(expected)
    # A 512-token chunk: compute-bound at 60% of 312 TFLOP/s.
    chunk = StepShape(num_tokens=512, num_seqs=1, num_kv_tokens=512, num_attn_pairs=512 * 513 // 2)
    flops = 2 * params * 512 + 4 * 32 * 32 * 128 * (512 * 513 // 2)
    assert model.step_seconds(chunk) == pytest.approx(flops / (312e12 * 0.6) + 0.0005)


def test_setting_builds(repro):
    assert repro.MODEL_CONFIG.exists()
    for trace, (path, max_model_len) in repro.TRACES.items():
        lengths = repro.read_lengths(path)
        assert len(lengths) == 2048 and all(p + d <= max_model_len for p, d in lengths)
    strict = repro.SETTINGS[0]
    vllm = repro.scheduler_config("vllm", strict, 8192)
    sarathi = repro.scheduler_config("sarathi", strict, 8192)
    assert not vllm.enable_chunked_prefill and vllm.max_num_batched_tokens == 8192
    assert sarathi.enable_chunked_prefill and sarathi.max_num_batched_tokens == 512


def test_tiny_run_gives_the_table_columns(repro):
    strict = repro.SETTINGS[0]
    trial = repro.run_once("chat", "sarathi", strict, rate=2.0, num_requests=16)
    assert set(trial) >= {"rate", "tbt_p99_s", "sched_delay_p50_s", "ok"}
    assert 0 < trial["tbt_p99_s"] < strict.tbt_slo_s  # chunks of 512 keep decodes steady
    # Capacities given by hand (no sweep): the table prints both and their ratio.
    results = {("chat", "strict"): {"vllm": {"capacity": 1.0}, "sarathi": {"capacity": 2.78}}}
    table = repro.table(results)
    assert "| chat | strict (0.1 s) | 512 | 1.00 | 2.78 | 2.78x | 2.78x | 1.00 |" in table
    assert table.splitlines()[0].count("|") == 9
