"""bench/kv_layouts.py (issue 34 item 4): the prompts of its batch, the decode
rate it reads from the step times, and its table. The sitting itself (4k
contexts, 64 sequences, beside llama.cpp) is the benchmark's, not the suite's."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))  # (it imports bench/throughput.py)
    try:
        spec = importlib.util.spec_from_file_location("kv_layouts_bench", BENCH / "kv_layouts.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def test_the_batch_shares_its_prefix_and_then_differs(bench):
    ids = list(range(100))
    prompts = bench.batch_prompts(ids, {"shared_tokens": 40, "context": 60, "batch": 3})
    assert [len(p) for p in prompts] == [60, 60, 60]
    assert all(p[:40] == ids[:40] for p in prompts)
    assert [p[40] for p in prompts] == [40, 47, 54]  # each its own slice of the text
    assert bench.text_ids(lambda text: [1, 2, 3], 7) == [1, 2, 3, 1, 2, 3, 1]


def test_the_decode_rate_counts_the_steps_after_every_first_token(bench):
    # 3 sequences: "a" decodes from t=1 while "b" and "c" still prefill (3 tokens
    # before every sequence has one: not yet decode-only), then 3 tokens a step.
    steps = [(0.5, [], 0), (1.0, ["a"], 1), (1.5, ["a"], 1), (1.7, ["a", "b"], 2), (2.0, ["a", "c"], 2),
             (2.5, ["a", "b", "c"], 3), (3.0, ["a", "b", "c"], 3), (4.0, ["a", "c"], 2)]
    assert bench.decode_rate(steps, 3) == pytest.approx(8 / 2.0)
    with pytest.raises(AssertionError, match="no decode-only step"):
        bench.decode_rate([(1.0, ["a", "b", "c"], 3)], 3)


def test_the_table_names_each_system_layout_and_cache(bench):
    results = {"cadence / windowed / q8_0": {"tokens in 1 GiB": 1234567, "single-stream decode tok/s": 70.04,
                                             "batch decode tok/s": 250.0}}
    table = bench.report(results, {"context": 4096, "batch": 64})
    assert "tokens in 1 GiB (4,096-token sequences)" in table and "batch-64 decode tok/s" in table
    assert table.splitlines()[-1] == "| cadence | windowed | q8_0 | 1,234,567 | 70.0 | 250.0 |"
