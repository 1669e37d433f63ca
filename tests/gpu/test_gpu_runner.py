"""The runner's Triton path: greedy parity with transformers, CUDA graphs, memory.

Models are tiny random Llama / Qwen2 / Mistral configs saved by transformers
and loaded by cadence (float32, so greedy tokens must agree exactly). The
schedule mixes chunked prefills with decodes of other requests.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from cadence.models.hf_loader import load_hf_model
from cadence.runner.model_runner import ModelRunner
from tests.models.test_hf_loading import CASES, save_random_model
from tests.runner.test_model_runner import BLOCK_SIZE, NUM_BLOCKS, HandScheduler

CASES.setdefault("mistral-window", (transformers.MistralConfig, dict(sliding_window=6, head_dim=16)))


def make_runner(model, device, **kwargs):
    return ModelRunner(
        model, model.config, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, dtype=torch.float32,
        max_num_seqs=8, max_model_len=256, device=device, attention_backend="triton", **kwargs,
    )


@torch.inference_mode()
def hf_greedy(hf, prompt, num_tokens):
    """Full recompute each token with transformers: the reference."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        logits = hf(torch.tensor([tokens], device=hf.device)).logits[0, -1]
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


def drive_mixed(runner, prompts, num_new, seed=0):
    """Chunked prefills beside decodes, then decodes; returns each request's tokens."""
    sched = HandScheduler(runner, seed=seed)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt)
    # r0 prefills whole; the others in two chunks, the second beside r0's decodes.
    first = {f"r{i}": (len(p) if i == 0 else len(p) // 2) for i, p in enumerate(prompts)}
    sched.step(first)
    sched.step()  # everyone catches up; r0 decodes
    while min(len(sched.outputs(r)) for r in sched.reqs) < num_new:
        sched.step({r: 1 for r in sched.reqs if len(sched.outputs(r)) < num_new})
    return [sched.outputs(f"r{i}")[:num_new] for i in range(len(prompts))]


@pytest.mark.parametrize("case", ["llama", "qwen2-tied", "mistral-window"])
def test_greedy_matches_transformers(case, device, tmp_path):
    hf = save_random_model(case, tmp_path).to(device)
    model, _ = load_hf_model(str(tmp_path), torch.float32)
    model.to(device)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 128) for _ in range(n)] for n in (5, 19, 33)]
    num_new = 12 if device.type == "cuda" else 6
    got = drive_mixed(make_runner(model, device), prompts, num_new)
    expected = [hf_greedy(hf, p, num_new) for p in prompts]
    assert got == expected


@pytest.mark.cuda
def test_cuda_graph_replay_equals_eager(tmp_path, device):
    save_random_model("llama", tmp_path)
    model, _ = load_hf_model(str(tmp_path), torch.float32)
    model.to(device)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 128) for _ in range(n)] for n in (7, 12, 30)]
    eager = make_runner(model, device)
    graphed = make_runner(model, device)
    graphed.capture_cuda_graphs([1, 2, 4, 8])
    expected = drive_mixed(eager, prompts, 40)
    got = drive_mixed(graphed, prompts, 40)
    assert got == expected
    # 3 requests pad to the graph of 4; the decodes after both prefill steps replay it.
    assert graphed.decode_graphs.num_replays >= 30


@pytest.mark.cuda
def test_no_gpu_memory_leak_over_many_steps(tmp_path, device):
    save_random_model("qwen2-tied", tmp_path)
    model, _ = load_hf_model(str(tmp_path), torch.float32)
    model.to(device)
    runner = make_runner(model, device)
    runner.capture_cuda_graphs([1, 2, 4, 8])
    rng = random.Random(2)

    def wave(seed):
        prompts = [[rng.randrange(3, 128) for _ in range(rng.randint(3, 40))] for _ in range(5)]
        sched = HandScheduler(runner, seed=seed)
        for i, p in enumerate(prompts):
            sched.add(f"w{seed}-{i}", p)
        sched.step()
        sched.decode(20)
        for req_id in list(sched.reqs):
            sched.finish(req_id)
        sched.step({})  # delivers the finished ids
        assert not runner.requests and runner.input_batch.num_reqs == 0

    wave(0)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    for seed in range(1, 30):
        wave(seed)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(device) - before < 1 << 20


@pytest.mark.cuda
def test_kv_cache_sized_from_gpu_memory_utilization(tmp_path, device):
    from cadence.runner.gpu_memory import gpu_kv_blocks
    from cadence.runner.kv_cache import bytes_per_block

    save_random_model("llama", tmp_path)
    model, _ = load_hf_model(str(tmp_path), torch.float32)
    model.to(device)
    runner = ModelRunner(model, model.config, block_size=16, num_blocks=1, dtype=torch.float32,
                         max_num_seqs=16, max_model_len=256, device=device)
    total = torch.cuda.mem_get_info(device)[1]
    low, _ = gpu_kv_blocks(runner, 0.2, max_num_batched_tokens=2048, max_num_seqs=16)
    high, figures = gpu_kv_blocks(runner, 0.4, max_num_batched_tokens=2048, max_num_seqs=16)
    block = bytes_per_block(model.config, 16, torch.float32)
    # Twice the share, and the extra 20% of the GPU is all KV cache.
    assert abs((high - low) * block - 0.2 * total) < 2 * block
    runner.allocate_kv_cache(high)
    assert torch.cuda.memory_allocated(device) <= 0.4 * total
    assert figures["peak_torch"] > 0


def test_greedy_with_split_key_decodes_matches_transformers(device, tmp_path):
    """Decode steps of few sequences split their keys (flash-decoding) and still agree."""
    hf = save_random_model("llama", tmp_path).to(device)
    model, _ = load_hf_model(str(tmp_path), torch.float32)
    model.to(device)
    runner = make_runner(model, device)
    runner.stager.num_sms = 64  # as if on a large GPU: 3 sequences x 2 KV heads split 16 ways
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 128) for _ in range(n)] for n in (9, 40, 70)]
    num_new = 10 if device.type == "cuda" else 5
    assert drive_mixed(runner, prompts, num_new) == [hf_greedy(hf, p, num_new) for p in prompts]
