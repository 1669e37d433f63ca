#!/usr/bin/env python3
"""Abuse soak (issue 30, item 7): the engine process's memory after the
abusive requests of the issue comes back to where warm-up left it.

    python bench/abuse_soak.py [--rounds 12] [--bound 0.10] [--json out.json] [-- serve flags]

Starts ``cadence serve`` on a free loopback port (the test suite's small
set-up: one thread, 512 KV blocks, ``--max-model-len 2048``), warms it up
with normal requests (completions and chats, streamed or not, ``n=2``, a
small choice list and a JSON schema, a 500-token prompt), then distinct
500-token prompts, four at a time, until they have used every KV block
(KV pages are committed on first write: ``--light-warmup`` skips this, and
the cache's pages then count as growth), reads the RSS of the engine-core
process (and of its KV cache's mapping, of the front end and of the grammar
checker's worker, for the record), then sends ``--rounds`` rounds of the issue's
abusive requests (about 13 each): grammar chains over the rule limit and at
it, a 100,000-string choice list, a 20,000-string one (served; a new list
each round, so no cache answers it), ``[^\\s\\S]``, a ``$ref`` cycle,
``repetition_penalty`` 1e-40, ``cache_salt``, unknown fields, bodies over the
size limit (with and without Content-Length), a 1 MB model name, prompts
near ``max_model_len``, ``n=4`` with ``logprobs=20`` and stop strings. Then
one normal request, a few seconds of rest, and the RSS again. Prints a JSON
summary: each RSS, the ratio after/warm, statuses per kind, and whether the
server answered everything it should (no 5xx, no dropped connection but
the oversized bodies'). Exit code 1 if the ratio is over ``1 + --bound`` or
a check fails. Extra arguments after ``--`` go to ``cadence serve``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests.server.serverlib

import httpx  # noqa: E402

from cadence.models.default_model import DEFAULT_MODEL_NAME  # noqa: E402
from tests.server.serverlib import (  # noqa: E402
    Server, _children, start_server, stop_server, wait_until,
)

MODEL = DEFAULT_MODEL_NAME
MAX_MODEL_LEN = 2048  # serverlib's BASE_ARGS
NUM_KV_SLOTS = 512 * 16  # serverlib's BASE_ARGS: --num-gpu-blocks 512, blocks of 16
CYCLE = {"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                   "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
         "$ref": "#/$defs/a"}
PROMPTS = ["Tell me a story about a lighthouse.", "Why is the sky blue?", "List three prime numbers.",
           "Write a haiku about continuous batching.", "What is the capital of France?"]


def chain(num_rules: int, tag: str = "x") -> str:
    """``start: r0``, ``r0: "x0" | r1``, ...: the issue's crashing grammar shape."""
    rules = [f'r{i}: "{tag}{i}" | r{i + 1}' for i in range(num_rules - 1)]
    return "\n".join(["start: r0", *rules, f'r{num_rules - 1}: "{tag}{num_rules - 1}"'])


# ---------------------------------------------------------------- requests


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) / 1024


def processes(server: Server) -> dict[str, int | None]:
    """The engine core (the first spawned child), the grammar checker's worker, the front end."""
    workers = [pid for pid in _children(server.process.pid)
               if b"check_worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    return {"engine": server.engine_pid(), "front_end": server.process.pid,
            "grammar_worker": max(workers, default=None)}


def kv_cache_rss_mib(pid: int) -> tuple[float, float]:
    """(size, resident MiB) of the engine's largest anonymous mapping: the paged KV
    cache (one mapping, its pages committed as blocks are first written)."""
    largest = (0, 0)
    size = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and fields[0].count("-") == 1 and ":" not in fields[0]:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            size = end - start if len(fields) == 5 else None  # no path: anonymous
        elif fields and fields[0] == "Rss:" and size is not None and size > largest[0]:
            largest = (size, int(fields[1]) << 10)
    return round(largest[0] / 2**20, 1), round(largest[1] / 2**20, 1)


def memory(server: Server) -> dict[str, float | None]:
    rss = {name: None if pid is None else round(rss_mib(pid), 1)
           for name, pid in processes(server).items()}
    kv_size, kv_rss = kv_cache_rss_mib(server.engine_pid())
    return {**rss, "engine_kv_cache": kv_rss, "engine_without_kv_cache": round(rss["engine"] - kv_rss, 1),
            "kv_cache_size": kv_size}


def complete(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/v1/completions", json={"model": MODEL, "prompt": "Answer:", "max_tokens": 8,
                                              "temperature": 0, **body})


def chat(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **body})


def normal_requests(http: httpx.Client, rng: random.Random) -> list[tuple[str, int]]:
    """One round of ordinary traffic: (kind, status) per request."""
    statuses = []
    for i, prompt in enumerate(PROMPTS):
        statuses.append(("completion", complete(http, prompt=prompt, max_tokens=16).status_code))
        statuses.append(("chat", chat(http, messages=[{"role": "user", "content": prompt}],
                                      max_tokens=16, n=2, temperature=0.7).status_code))
        with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                           "max_tokens": 16, "stream": True}) as r:
            r.read()
            statuses.append(("stream", r.status_code))
    statuses.append(("choice", complete(http, structured_outputs={"choice": ["yes", "no"]}).status_code))
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    statuses.append(("json", complete(http, structured_outputs={"json": schema}, max_tokens=16).status_code))
    long_prompt = [rng.randrange(100, 40000) for _ in range(500)]
    statuses.append(("prompt_500", complete(http, prompt=long_prompt, max_tokens=8).status_code))
    return statuses


def fill_kv_cache(http: httpx.Client, rng: random.Random, num_slots: int) -> list[tuple[str, int]]:
    """Distinct 500-token prompts, four at a time (steps of the full token
    budget), until their tokens exceed the KV cache's slots: a server that has
    run for a while has used every block (the prefix cache keeps them), which
    a few short requests do not show, since pages are committed on first write."""
    statuses = []
    bodies = [{"model": MODEL, "prompt": [rng.randrange(100, 40000) for _ in range(500)], "max_tokens": 4}
              for _ in range(num_slots // 500 + 4)]
    with ThreadPoolExecutor(4) as pool:
        for status in pool.map(lambda body: http.post("/v1/completions", json=body).status_code, bodies):
            statuses.append(("fill_kv", status))
    return statuses


def abusive_requests(http: httpx.Client, round_index: int, rng: random.Random,
                     only: set[str] | None = None) -> list[tuple[str, int | str]]:
    """One round of the issue's abusive requests (those of the kinds in ``only``,
    if given): (kind, status or the error's class)."""
    statuses = []
    for kind, send in abusive_cases(http, round_index, rng):
        if only is not None and kind not in only:
            continue
        try:
            statuses.append((kind, send().status_code))
        except httpx.HTTPError as err:  # an oversized body may be cut off while it is sent
            statuses.append((kind, type(err).__name__))
    return statuses


def abusive_cases(http: httpx.Client, round_index: int, rng: random.Random) -> list[tuple[str, Any]]:
    """(kind, a call that sends it); the constraints differ from round to round,
    so that no cache answers a round from the one before."""
    tag = f"r{round_index}_"
    return [
        ("grammar_over_limit", lambda: complete(http, structured_outputs={"grammar": chain(5000, tag)})),
        ("grammar_2000", lambda: complete(http, structured_outputs={"grammar": chain(2000, tag)})),
        ("choice_100k", lambda: complete(http, structured_outputs={
            "choice": [f"{tag}choice {i}" for i in range(100_000)]})),
        ("choice_20k", lambda: complete(http, max_tokens=12, structured_outputs={
            "choice": [f"{tag}item number {i}" for i in range(20_000)]})),
        ("regex_empty", lambda: complete(http, structured_outputs={"regex": r"[^\s\S]" + tag})),
        ("ref_cycle", lambda: complete(http, structured_outputs={"json": {**CYCLE, "title": tag}})),
        ("repetition_penalty", lambda: complete(http, repetition_penalty=1e-40)),
        ("cache_salt_unknown_fields", lambda: chat(http, cache_salt=f"tenant-{round_index}",
                                                   **{f"x_unknown_{round_index}": 1, "foo": [1, 2]})),
        ("body_9mib", lambda: http.post("/v1/completions", content=b'{"prompt": "' + b"x" * (9 << 20),
                                        headers={"content-type": "application/json"})),
        ("body_9mib_chunked", lambda: http.post("/v1/completions", content=_chunks(9 << 20),
                                                headers={"content-type": "application/json"})),
        ("model_1mb", lambda: complete(http, model="m" * (1 << 20))),
        ("prompt_near_max_len", lambda: complete(http, prompt=[rng.randrange(100, 40000)
                                                               for _ in range(MAX_MODEL_LEN - 40)],
                                                 max_tokens=32)),
        ("n4_logprobs20_stop", lambda: complete(http, prompt=rng.choice(PROMPTS), n=4, logprobs=20,
                                                max_tokens=32, temperature=1.0,
                                                stop=["\n\n", "the", "."])),
    ]


def _chunks(num_bytes: int):
    yield b'{"prompt": "'
    for _ in range(num_bytes // (1 << 20)):
        yield b"x" * (1 << 20)


# Statuses each abusive kind may get (the oversized bodies may also see the
# connection closed while they are still being sent).
EXPECTED = {"grammar_over_limit": {400}, "grammar_2000": {400}, "choice_100k": {400},
            "choice_20k": {200}, "regex_empty": {400}, "ref_cycle": {400},
            "repetition_penalty": {400}, "cache_salt_unknown_fields": {200},
            "body_9mib": {413, "RemoteProtocolError", "WriteError", "ReadError"},
            "body_9mib_chunked": {413, "RemoteProtocolError", "WriteError", "ReadError"},
            "model_1mb": {404}, "prompt_near_max_len": {200}, "n4_logprobs20_stop": {200}}


# ---------------------------------------------------------------- the run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12, help="rounds of abusive requests (default 12)")
    parser.add_argument("--warmup-rounds", type=int, default=3, help="rounds of normal requests (default 3)")
    parser.add_argument("--bound", type=float, default=0.10,
                        help="most the engine's RSS may grow over warm-up, as a fraction (default 0.10)")
    parser.add_argument("--light-warmup", action="store_true",
                        help="warm up without filling the KV cache (its pages then count as growth)")
    parser.add_argument("--rest-s", type=float, default=5.0, help="rest before each reading (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", type=lambda text: set(text.split(",")),
                        help="only these kinds of abusive request, comma-separated (to find which "
                             f"one grows memory): {', '.join(EXPECTED)}")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    parser.add_argument("serve_args", nargs="*", help="extra cadence serve flags (after --)")
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    server = start_server("abuse-soak", args.serve_args, Path(tempfile.mkdtemp(prefix="cadence-abuse-")))
    try:
        summary = run(server, args, rng)
    finally:
        stop_server(server)
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary["passed"] else 1


def run(server: Server, args: argparse.Namespace, rng: random.Random) -> dict:
    start = time.monotonic()
    with httpx.Client(base_url=server.base_url, timeout=300) as http:
        warm_statuses = []
        for _ in range(args.warmup_rounds):
            warm_statuses += normal_requests(http, rng)
        if not args.light_warmup:
            warm_statuses += fill_kv_cache(http, rng, NUM_KV_SLOTS)
        time.sleep(args.rest_s)
        warm = memory(server)
        timeline = [("warm", warm["engine"])]
        abuse_statuses = []
        for round_index in range(args.rounds):
            abuse_statuses += abusive_requests(http, round_index, rng, args.only)
            timeline.append((f"round {round_index}", rss_mib(server.engine_pid())))
            print(f"abuse soak: round {round_index}, engine RSS {timeline[-1][1]:.0f} MiB, "
                  f"{time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
        final_status = complete(http, prompt=PROMPTS[0], max_tokens=16).status_code
        time.sleep(args.rest_s)
        after = memory(server)
    at_rest = wait_until(lambda: _idle(server), 30)
    ratio = after["engine"] / warm["engine"]
    ratio_without_kv = after["engine_without_kv_cache"] / warm["engine_without_kv_cache"]
    unexpected = [f"{kind}: {status}" for kind, status in abuse_statuses if status not in EXPECTED[kind]]
    unexpected += [f"warm-up {kind}: {status}" for kind, status in warm_statuses if status != 200]
    passed = (ratio <= 1 + args.bound and not unexpected and final_status == 200 and at_rest
              and server.process.poll() is None)
    return {
        "serve_args": args.serve_args, "warmup_requests": len(warm_statuses),
        "abusive_requests": len(abuse_statuses), "statuses": _count(abuse_statuses),
        "unexpected": unexpected, "final_request": final_status, "at_rest": at_rest,
        "rss_mib_warm": warm, "rss_mib_after": after, "engine_ratio": round(ratio, 3),
        "engine_ratio_without_kv_cache": round(ratio_without_kv, 3), "light_warmup": args.light_warmup,
        "bound": args.bound, "engine_timeline_mib": " ".join(f"{label}:{rss:.0f}" for label, rss in timeline),
        "seconds": round(time.monotonic() - start), "passed": passed,
    }


def _idle(server: Server) -> bool:
    metrics = server.metrics()
    return (metrics.get("cadence:num_requests_running", 0) == 0
            and metrics.get("cadence:num_requests_waiting", 0) == 0)


def _count(statuses: list[tuple[str, int | str]]) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for kind, status in statuses:
        by_status = counts.setdefault(kind, {})
        by_status[str(status)] = by_status.get(str(status), 0) + 1
    return counts


if __name__ == "__main__":
    sys.exit(main())
