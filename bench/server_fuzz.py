#!/usr/bin/env python3
"""The long run of the suite's fuzzer (tests/server/test_fuzz.py): schemathesis
drives every route of a live server's OpenAPI schema, round after round with a
new seed each, until the time is up.

    python bench/server_fuzz.py --minutes 5 [--max-examples 100] [--base-url URL --model NAME]

Without --base-url it starts its own ``cadence serve`` on a free loopback port
(the test suite's small set-up) and stops it at the end. Reports the cases
sent, the statuses per route, the slowest answer, and every finding (a 5xx,
or no answer within --response-timeout), then checks that the server is at
rest and still serves a normal request. Exit code 1 if anything was found.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests.server.serverlib

import httpx  # noqa: E402

from tests.server.serverlib import fuzz, start_server, stop_server, wait_until  # noqa: E402
from cadence.models.default_model import DEFAULT_MODEL_NAME

DEFAULT_MODEL = DEFAULT_MODEL_NAME


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="how long to fuzz (default 5)")
    parser.add_argument("--max-examples", type=int, default=100,
                        help="cases per route and mode in one round (default 100)")
    parser.add_argument("--response-timeout", type=float, default=30.0,
                        help="seconds an answer may take before it is a finding (default 30)")
    parser.add_argument("--base-url", help="fuzz this running server instead of starting one")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the served model's name")
    parser.add_argument("--api-key", help="the server's --api-key, if it has one")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args(argv)

    server = None
    if args.base_url is None:
        server = start_server("fuzz-bench", [], Path(tempfile.mkdtemp(prefix="cadence-fuzz-")))
    base_url = args.base_url or server.base_url
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        summary = run_rounds(base_url, args, headers)
        summary["after"] = check_after(base_url, args.model, headers)
    finally:
        if server is not None:
            stop_server(server)
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    healthy = summary["after"]["normal_request"] == 200 and summary["after"]["at_rest"]
    return 0 if not summary["findings"] and healthy else 1


def run_rounds(base_url: str, args: argparse.Namespace, headers: dict[str, str]) -> dict:
    deadline = time.monotonic() + args.minutes * 60
    start = time.monotonic()
    num_cases, statuses, findings, slowest_s, seed = 0, {}, [], 0.0, 0
    while time.monotonic() < deadline:
        report = fuzz(base_url, args.model, args.max_examples, headers=headers,
                      response_timeout_s=args.response_timeout, seed=seed)
        num_cases += report.num_cases
        slowest_s = max(slowest_s, report.slowest_s)
        findings += [f"seed {seed}: {finding}" for finding in report.findings]
        for label, counts in report.statuses.items():
            for status, count in counts.items():
                route = statuses.setdefault(label, {})
                route[status] = route.get(status, 0) + count
        print(f"round {seed}: {report.num_cases} cases, {len(report.findings)} findings, "
              f"{time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
        seed += 1
    return {"rounds": seed, "cases": num_cases, "seconds": round(time.monotonic() - start, 1),
            "slowest_answer_s": round(slowest_s, 2), "statuses": statuses, "findings": findings}


def check_after(base_url: str, model: str, headers: dict[str, str]) -> dict:
    """Nothing left running or holding KV blocks, and a normal request is served."""

    def gauge(name: str) -> float:
        text = httpx.get(f"{base_url}/metrics", headers=headers, timeout=30).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))

    at_rest = wait_until(lambda: gauge("cadence:num_requests_running") == 0
                         and gauge("cadence:kv_cache_usage_perc") == 0.0, 60)
    response = httpx.post(f"{base_url}/v1/completions", headers=headers, timeout=60,
                          json={"model": model, "prompt": "Hi", "max_tokens": 2})
    return {"at_rest": at_rest, "normal_request": response.status_code}


if __name__ == "__main__":
    sys.exit(main())
