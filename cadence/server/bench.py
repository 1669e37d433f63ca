"""Load benchmark of a running server: Poisson arrivals, latency percentiles, throughput.

    cadence bench serve --rate 0.5 --num-prompts 64
    cadence bench serve --rate inf --num-prompts 32 --synthetic --input-len 256 --output-len 64

Each request is a streamed /v1/completions call with token-id prompts
(greedy, EOS ignored, exactly ``--output-len`` new tokens), so the work does
not depend on what the model writes. Prompts come from the
``cpu-throughput-v1`` workload (the 64 chat-templated prompts, cycled) or
are synthetic random token ids. Arrivals: exponential gaps with mean
1/rate (``inf``: all at once). Per request it measures

    TTFT  first streamed token - send          ITL   gaps between streamed chunks
    TPOT  (end - first token) / (tokens - 1)   E2E   end - send

and reports mean, median, p90 and p99 of each, and requests/s and tokens/s
over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORKLOAD = "cpu-throughput-v1"
WORKLOAD_FILE = Path(__file__).resolve().parents[3] / "shared" / "workloads" / f"{WORKLOAD}.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address")
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    parser.add_argument("--rate", type=float, default=float("inf"),
                        help="mean request arrivals per second (inf: all at once)")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests to send")
    parser.add_argument("--workload", default=str(WORKLOAD_FILE),
                        help="JSON file with 'prompt_ids' (default: cpu-throughput-v1)")
    parser.add_argument("--synthetic", action="store_true",
                        help="random token-id prompts of --input-len tokens instead")
    parser.add_argument("--input-len", type=int, default=128, help="synthetic prompt length")
    parser.add_argument("--output-len", type=int, default=128, help="new tokens per request")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="most requests in flight (default: no limit)")
    parser.add_argument("--seed", type=int, default=0, help="seed of arrivals and synthetic prompts")
    parser.add_argument("--timeout", type=float, default=1800.0, help="per-request timeout, seconds")
    parser.add_argument("--result-json", default=None, help="also write the results here")


@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def load_prompts(args: argparse.Namespace) -> tuple[str, list[list[int]]]:
    rng = random.Random(args.seed)
    path = Path(args.workload)
    if not args.synthetic and path.exists():
        data = json.loads(path.read_text())
        ids = data["prompt_ids"]
        name = data.get("workload", path.stem)
        return name, [ids[i % len(ids)] for i in range(args.num_prompts)]
    prompts = [[rng.randrange(1000, 20000) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]
    return f"synthetic-{args.input_len}", prompts


def arrival_gaps(rate: float, count: int, seed: int) -> list[float]:
    """Seconds to wait before each request: exponential with mean 1/rate (Poisson arrivals)."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed + 1)
    return [rng.expovariate(rate) for _ in range(count)]


async def send_one(client: Any, url: str, model: str, prompt: list[int], output_len: int,
                   timeout: float) -> RequestResult:
    result = RequestResult(prompt_len=len(prompt))
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not any(c.get("text") for c in chunk.get("choices", ())):
                    continue
                now = time.perf_counter()
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
        result.e2e = time.perf_counter() - start
        result.ok = result.ttft > 0.0
        if not result.ok:
            result.error = "no token came back"
    except Exception as err:  # a failed request is counted, the run goes on
        result.error = f"{type(err).__name__}: {err}"
    return result


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    workload, prompts = load_prompts(args)
    gaps = arrival_gaps(args.rate, len(prompts), args.seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, limits=limits, timeout=args.timeout) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        semaphore = asyncio.Semaphore(args.max_concurrency or len(prompts) or 1)

        async def limited(prompt: list[int]) -> RequestResult:
            async with semaphore:
                return await send_one(client, "/v1/completions", model, prompt, args.output_len,
                                      args.timeout)

        tasks = []
        start = time.perf_counter()
        for gap, prompt in zip(gaps, prompts):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(args, workload, model, results, duration)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pct(q: float) -> float:
        k = (len(ordered) - 1) * q
        lo, hi = math.floor(k), math.ceil(k)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"mean": statistics.fmean(ordered), "median": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}


def summarize(args: argparse.Namespace, workload: str, model: str, results: list[RequestResult],
              duration: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_len for r in done)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {
        "workload": workload, "model": model, "base_url": args.base_url,
        "rate": args.rate, "num_prompts": len(results), "output_len": args.output_len,
        "max_concurrency": args.max_concurrency, "machine": machine(),
        "completed": len(done), "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration else 0.0,
        "input_tokens": input_tokens, "output_tokens": output_tokens,
        "ttft_s": percentiles([r.ttft for r in done]),
        "tpot_s": percentiles(tpot),
        "itl_s": percentiles([gap for r in done for gap in r.itl]),
        "e2e_s": percentiles([r.e2e for r in done]),
    }


def machine() -> str:
    import os

    return f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def format_report(s: dict[str, Any]) -> str:
    lines = [
        f"{'=' * 18} Serving benchmark {'=' * 18}",
        f"workload            {s['workload']} (model {s['model']}, {s['output_len']} new tokens each)",
        f"request rate        {s['rate']} req/s (Poisson)" + (
            f", concurrency <= {s['max_concurrency']}" if s["max_concurrency"] else ""),
        f"completed / failed  {s['completed']} / {s['failed']}",
        f"duration            {s['duration_s']:.2f} s",
        f"requests/s          {s['request_throughput']:.3f}",
        f"output tokens/s     {s['output_throughput']:.1f}",
        f"total tokens/s      {s['total_token_throughput']:.1f}",
        f"{'':18}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}   (ms)",
    ]
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        p = s[key]
        lines.append(f"{label:<18}" + "".join(f"{p[q] * 1000:>10.1f}" for q in ("mean", "median", "p90", "p99")))
    for error in s["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def main_from_args(args: argparse.Namespace) -> int:
    if args.num_prompts < 1:
        raise ValueError("num_prompts: must be >= 1")
    if not args.rate > 0:
        raise ValueError("rate: must be > 0 (inf: all at once)")
    summary = asyncio.run(run(args))
    print(format_report(summary))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(summary, indent=2))
    return 0 if summary["completed"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    return main_from_args(parser.parse_args(argv))
