#!/usr/bin/env python3
"""Prefill/decode disaggregation against one instance, side by side.

The same load (``cadence bench serve``: Poisson arrivals, streamed token-id
prompts, exactly ``--output-len`` tokens each) runs twice on this machine:

1. one ``cadence serve`` with ``--single-threads`` torch threads;
2. a prefill instance (kv_producer) and a decode instance (kv_consumer) with
   ``--pd-threads`` threads each, behind ``cadence proxy``.

It prints TTFT, TPOT and E2E percentiles and throughput of both, and the
ratios P/D over single. On one CPU the two instances split its cores; the
point of P/D there is that decode steps are never stalled by a long prefill
(TPOT), at the price of a transfer and a second prompt pass of one token.

    python bench/pd_disaggregation.py                       # defaults: 32 requests at 1 req/s
    python bench/pd_disaggregation.py --num-prompts 4 --output-len 8 --input-len 64   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "pd_disaggregation.json"
STARTUP_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], log_path: Path) -> tuple[subprocess.Popen, str]:
    """A cadence command listening on a free port; (process, base URL) once healthy."""
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "cadence.cli", *args, "--port", str(port)],
                                   stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{' '.join(args[:1])} exited:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"{args[0]} did not become healthy:\n{log_path.read_text()}")


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
    for process in processes:
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def serve_args(args, threads: int, kv_config: dict | None = None) -> list[str]:
    flags = ["serve", "--num-threads", str(threads), "--max-model-len", str(args.max_model_len)]
    if args.model:
        flags += ["--model", args.model]
    if kv_config is not None:
        flags += ["--kv-transfer-config", json.dumps(kv_config)]
    return flags


def load(args, base_url: str) -> dict:
    from cadence.server.bench import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    bench_args = parser.parse_args([
        "--base-url", base_url, "--rate", str(args.rate), "--num-prompts", str(args.num_prompts),
        "--output-len", str(args.output_len), "--seed", "0",
        *(["--synthetic", "--input-len", str(args.input_len)] if args.input_len else []),
    ])
    return asyncio.run(run(bench_args))


def single(args, logs: Path) -> dict:
    process, url = start(serve_args(args, args.single_threads), logs / "single.log")
    try:
        return load(args, url)
    finally:
        stop([process])


def disaggregated(args, logs: Path) -> dict:
    pd = {"kv_connector": "PDConnector"}
    prefill = start(serve_args(args, args.pd_threads, {
        **pd, "kv_role": "kv_producer", "kv_connector_extra_config": {"kv_port": free_port()}}),
        logs / "prefill.log")
    processes = [prefill[0]]
    try:
        decode = start(serve_args(args, args.pd_threads, {**pd, "kv_role": "kv_consumer"}),
                       logs / "decode.log")
        processes.append(decode[0])
        proxy = start(["proxy", "--prefill", prefill[1], "--decode", decode[1],
                       "--log-level", "warning"], logs / "proxy.log")
        processes.append(proxy[0])
        return load(args, proxy[1])
    finally:
        stop(processes[::-1])


def report(results: dict) -> None:
    rows = [("requests/s", "request_throughput", None), ("output tokens/s", "output_throughput", None),
            ("TTFT median ms", "ttft_s", "median"), ("TTFT p90 ms", "ttft_s", "p90"),
            ("TPOT median ms", "tpot_s", "median"), ("TPOT p90 ms", "tpot_s", "p90"),
            ("E2E median ms", "e2e_s", "median")]
    single, pd = results["single"], results["pd"]
    print(f"{'':20}{'single':>12}{'P/D':>12}{'P/D / single':>14}")
    for label, key, q in rows:
        a, b = (single[key], pd[key]) if q is None else (single[key][q] * 1e3, pd[key][q] * 1e3)
        print(f"{label:20}{a:12.2f}{b:12.2f}{(b / a if a else float('nan')):14.3f}")
    print(f"completed/failed: single {single['completed']}/{single['failed']}, "
          f"P/D {pd['completed']}/{pd['failed']}")


def main() -> int:
    cores = os.cpu_count() or 2
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    parser.add_argument("--input-len", type=int, default=0,
                        help="synthetic prompts of this many tokens (0: the cpu-throughput-v1 prompts)")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--single-threads", type=int, default=max(1, cores - 1))
    parser.add_argument("--pd-threads", type=int, default=max(1, (cores - 1) // 2))
    parser.add_argument("--logs", default="/tmp/cadence-pd-bench")
    args = parser.parse_args()
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    print(f"command: {' '.join(sys.argv)}")
    print(f"machine: {platform.processor() or platform.machine()}, {cores} cores, "
          f"single {args.single_threads} threads, P/D {args.pd_threads} threads per instance")
    results = {"single": single(args, logs), "pd": disaggregated(args, logs)}
    report(results)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"command": sys.argv, "cores": cores, **results}, indent=2))
    print(f"written: {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
