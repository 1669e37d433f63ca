#!/usr/bin/env python3
"""Peak RSS with every default: one question, and a batch of 64 (issue 31, item 4).

Two runs, each in its own process, whose peak resident memory (``ru_maxrss``
of that child, read with ``os.wait4``) is the figure:

    generate    ``cadence generate "What is the capital of France?"``
    batch-64    ``LLM()`` and workload ``cpu-throughput-v1``: its 64 chat
                prompts submitted at once, greedy, 128 new tokens each (EOS
                ignored)

Cadence options given after ``--`` reach both runs (the CLI's flags), e.g.
``-- --kv-cache-dtype float16``; with none, every option keeps its default.
Issue 31's targets: generate <= 700 MiB; batch-64 <= 1.3x llama.cpp's peak
RSS on the same file (551 MiB in BENCHMARKS.md: <= 716 MiB). Memory only:
a shared machine skews timings, not these.

    python bench/kv_memory.py
    python bench/kv_memory.py --runs batch-64 -- --kv-cache-dtype float16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

WORKLOAD_FILE = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "cpu-throughput-v1.json"
QUESTION = "What is the capital of France?"
MAX_TOKENS = 128
RUNS = ("generate", "batch-64")
TARGETS_MIB = {"generate": 700, "batch-64": round(1.3 * 551)}


def batch_child(flags: list[str]) -> None:
    """The batch-64 run itself (in its own process): ``flags`` are cadence's options."""
    from cadence import LLM, SamplingParams
    from cadence.config_cli import add_config_options, options_of

    parser = argparse.ArgumentParser()
    add_config_options(parser)
    options = options_of(parser.parse_args(flags))
    prompt_ids = json.loads(WORKLOAD_FILE.read_text())["prompt_ids"]
    llm = LLM(**options)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    assert all(len(out.outputs[0].token_ids) == MAX_TOKENS for out in outputs)


def peak_rss_mib(command: list[str]) -> float:
    """Run ``command``; the peak RSS of that process, MiB (its output passes through)."""
    process = subprocess.Popen(command, stdout=sys.stderr)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"{command[:4]}... failed with exit code {process.returncode}")
    return usage.ru_maxrss / 1024  # KiB on Linux


def command_for(run: str, flags: list[str]) -> list[str]:
    if run == "generate":
        return [sys.executable, "-m", "cadence.cli", "generate", QUESTION, *flags]
    return [sys.executable, __file__, "--batch-child", *flags]


def main() -> None:
    if sys.argv[1:2] == ["--batch-child"]:
        batch_child(sys.argv[2:])
        return
    argv, flags = sys.argv[1:], []
    if "--" in argv:
        argv, flags = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default=",".join(RUNS), help="comma list of " + ", ".join(RUNS))
    args = parser.parse_args(argv)
    print(f"| run | options | peak RSS MiB | target MiB |\n|---|---|---:|---:|")
    for run in args.runs.split(","):
        mib = peak_rss_mib(command_for(run, flags))
        print(f"| {run} | {' '.join(flags) or 'defaults'} | {mib:,.0f} | <= {TARGETS_MIB[run]} |",
              flush=True)


if __name__ == "__main__":
    main()
