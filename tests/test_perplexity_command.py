"""bench/perplexity.py, the perplexity command the defaults, quantized-products
and KV-memory issues compare engines with: its chunks and scored positions,
and one short run on the default model (llama.cpp is the benchmark's, not the suite's)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "bench" / "perplexity.py"


def load_script():
    spec = importlib.util.spec_from_file_location("perplexity_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chunks_lead_with_bos_and_score_their_second_half():
    bench = load_script()
    chunks = bench.chunks_of(list(range(100, 130)), bos=1, ctx=8, max_chunks=None)
    assert chunks[0] == [1, 100, 101, 102, 103, 104, 105, 106]
    assert chunks[1][:2] == [1, 107] and len(chunks) == 4 and all(len(c) == 8 for c in chunks)
    assert bench.chunks_of(list(range(30)), bos=None, ctx=8, max_chunks=2)[1] == list(range(8, 16))
    assert list(bench.scored_positions(8)) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="^--ctx: the text has 5 tokens"):
        bench.chunks_of(list(range(5)), bos=1, ctx=8, max_chunks=None)
    figures = bench.perplexity([1.0, 2.0, 3.0])
    assert figures["ppl"] == pytest.approx(math.exp(2.0)) and figures["num_scored"] == 3


def test_one_chunk_of_the_default_model(tmp_path):
    out = tmp_path / "ppl.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--max-chunks", "1", "--ctx", "128", "--dtype", "float32",
         "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    cadence = report["cadence"]
    assert cadence["num_scored"] == 64 and report["chunks"] == 1
    # A 135M instruct model on plain English prose: far better than chance (vocab 49k).
    assert 1.5 < cadence["ppl"] < 200
    assert cadence["ppl"] == pytest.approx(math.exp(cadence["mean_nll"]))
