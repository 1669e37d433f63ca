#!/usr/bin/env python3
"""An agent loop's prefix-cache hits and TTFT per turn, against the cache off
(issue 35 item 3).

A 10-turn tool-calling conversation with the default model behind
``cadence serve``: a small tool (``get_weather``), turns that must call it
(``tool_choice: required``) alternating with free answers, each call's result
sent back as a tool message. The server gets a chat template that opens
``<think>`` at the generation prompt and strips earlier turns' thinking (as
Qwen3's does), ``--reasoning-parser qwen3`` and a thinking budget, so every
turn's prompt differs from the previous prompt + output where the thinking
was. Streamed and greedy; TTFT is the time to the first chunk that carries
a token (reasoning, content or a call). The same conversation runs twice:
prefix caching on, then off (``--no-enable-prefix-caching``).

    python bench/agent_loop.py                 # 10 turns, both runs
    python bench/agent_loop.py --turns 4
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "agent_loop.json"
MODEL = "SmolLM2-135M-Instruct"
TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CITIES = ["Paris", "Madrid", "Rome", "Berlin", "Lisbon", "Vienna", "Oslo", "Dublin", "Prague", "Athens"]


def get_weather(city: str) -> str:
    return f"{city}: {12 + len(city)} C, light wind, no rain."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(extra: list[str], template: str, budget: int, threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "cadence.server", "serve", "--port", str(port), "--num-threads",
         str(threads), "--max-model-len", "4096", "--reasoning-parser", "qwen3", "--chat-template",
         template, "--thinking-token-budget", str(budget), *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            raise RuntimeError("the server exited")
        time.sleep(0.5)
    process.kill()
    raise RuntimeError("the server did not start")


def one_turn(client: openai.OpenAI, messages: list[dict], tool_choice: str, max_tokens: int) -> dict:
    """Stream one turn: its TTFT, usage, text and calls."""
    start = time.perf_counter()
    ttft = None
    content, calls, usage = "", {}, None
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[TOOL], tool_choice=tool_choice, temperature=0,
        max_tokens=max_tokens, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta.model_dump()
        if ttft is None and (delta.get("reasoning") or delta.get("content") or delta.get("tool_calls")):
            ttft = time.perf_counter() - start
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            entry = calls.setdefault(call["index"], {"id": call.get("id"), "name": "", "arguments": ""})
            function = call.get("function") or {}
            entry["name"] += function.get("name") or ""
            entry["arguments"] += function.get("arguments") or ""
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {"ttft_s": ttft, "prompt_tokens": usage.prompt_tokens, "cached_tokens": cached or 0,
            "reasoning_tokens": usage.completion_tokens_details.reasoning_tokens,
            "content": content, "calls": list(calls.values())}


def run_loop(url: str, turns: int, max_tokens: int) -> list[dict]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    messages: list[dict] = [{"role": "system", "content": "You are a concise travel assistant."}]
    rows = []
    for turn in range(turns):
        city = CITIES[turn % len(CITIES)]
        must_call = turn % 2 == 0
        if must_call:
            messages.append({"role": "user", "content": f"What is the weather in {city}?"})
        result = one_turn(client, messages, "required" if must_call else "auto", max_tokens)
        rows.append({k: v for k, v in result.items() if k not in ("content", "calls")})
        if result["calls"]:
            messages.append({"role": "assistant", "content": result["content"] or None, "tool_calls": [
                {"id": c["id"] or f"call{turn}", "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}} for c in result["calls"]]})
            for c in result["calls"]:
                try:
                    args = json.loads(c["arguments"])
                except ValueError:
                    args = {}
                messages.append({"role": "tool", "tool_call_id": c["id"] or f"call{turn}",
                                 "content": get_weather(str(args.get("city", city)))})
        else:
            messages.append({"role": "assistant", "content": result["content"]})
            messages.append({"role": "user", "content": "Thanks. Anything else I should know?"})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--thinking-token-budget", type=int, default=16)
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args()
    with tempfile.NamedTemporaryFile("w", suffix=".jinja", delete=False) as f:
        f.write(TEMPLATE)
    runs = {}
    for name, extra in (("cache on", []), ("cache off", ["--no-enable-prefix-caching"])):
        process, url = start_server(extra, f.name, args.thinking_token_budget, args.num_threads)
        try:
            runs[name] = run_loop(url, args.turns, args.max_tokens)
        finally:
            process.terminate()
            process.wait(30)
    os.unlink(f.name)
    print("| turn | prompt tokens | cached (on) | hit rate (on) | TTFT on (ms) | TTFT off (ms) |")
    print("|---:|---:|---:|---:|---:|---:|")
    on, off = runs["cache on"], runs["cache off"]
    for i, (a, b) in enumerate(zip(on, off), 1):
        print(f"| {i} | {a['prompt_tokens']} | {a['cached_tokens']} | "
              f"{a['cached_tokens'] / a['prompt_tokens']:.0%} | {a['ttft_s'] * 1e3:.0f} | {b['ttft_s'] * 1e3:.0f} |")
    total = sum(a["prompt_tokens"] for a in on)
    hits = sum(a["cached_tokens"] for a in on)
    print(f"all turns: {hits}/{total} prompt tokens from the cache ({hits / total:.0%}); "
          f"TTFT sum {sum(a['ttft_s'] for a in on):.2f} s on, {sum(b['ttft_s'] for b in off):.2f} s off; "
          f"load average {os.getloadavg()[0]:.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
