"""``cadence serve --tensor-parallel-size 2``: the engine core's rank 0 and one
worker process serve a tiny random Llama (4 heads, 2 KV heads) with the
tokens one rank gives, and the worker exits when the server stops."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import torch

from cadence.engine.llm import LLM
from cadence.models.testing import random_model, tiny_config, write_hf_folder
from cadence.sampling_params import SamplingParams
from tests.server.serverlib import _children, start_server, stop_server

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def worker_pids(engine_pid: int) -> list[int]:
    return [pid for pid in _children(engine_pid)
            if b"cadence.runner.tp_workers" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def test_serve_splits_the_model_over_two_ranks(tmp_path):
    folder = str(tmp_path / "tiny")
    write_hf_folder(folder, random_model(tiny_config(), seed=3))
    threads = torch.get_num_threads()
    try:
        one_rank = LLM(folder, dtype="float32", num_gpu_blocks=64, max_model_len=256)
        expected = one_rank.generate({"prompt_token_ids": PROMPT}, SamplingParams(
            max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    finally:
        torch.set_num_threads(threads)
    server = start_server("tp", ["--model", folder, "--dtype", "float32", "--tensor-parallel-size", "2"],
                          tmp_path)
    try:
        workers = worker_pids(server.engine_pid())
        assert len(workers) == 1
        model = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        response = httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
            "model": model, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "logprobs": 0})
        assert response.status_code == 200, response.text
        assert "tensor parallel over 2 ranks" in server.log()
        tokens = response.json()["choices"][0]["logprobs"]["tokens"]
        assert len(tokens) == len(expected)
        text = response.json()["choices"][0]["text"]
        assert text == one_rank.tokenizer.decode(expected)
    finally:
        stop_server(server)
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers)
