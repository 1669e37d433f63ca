"""Newer families through the paged runner: every token's logits equal transformers'.

Each family's tiny random model (``tests/models/arch_cases.py``) is saved as
an HF folder, loaded by cadence and driven by ``HandScheduler``:

    step 1   a: prompt tokens 0..7                    (a chunked prefill)
    step 2   a: prompt tokens 8..20, samples
    step 3   a: 1 decode   b: tokens 12..18, samples  (b's first 12 tokens are a's:
                                                       a's first 3 blocks, a prefix-cache hit)
    4..6     a, b: 1 decode each

The model's forward is watched: the logits of every token it computed, at
every step, must equal transformers' logits for the same request at the same
position (full recompute), and the greedy tokens must be transformers' argmax.
On the runner's default CPU paths (packed weights, C kernels) and on plain PyTorch.
Gemma's tiny models have windows of 6 tokens, shorter than the prompts.
"""

import pytest
import torch

from cadence.models.hf_loader import load_hf_model
from cadence.runner.cpu_paths import CpuPaths, choose_cpu_paths
from cadence.runner.model_runner import ModelRunner
from tests.models.arch_cases import CASES, hf_logits, random_hf_model
from tests.runner.test_model_runner import BLOCK_SIZE, NUM_BLOCKS, HandScheduler

PROMPT_A = torch.randint(3, 256, (21,), generator=torch.Generator().manual_seed(1)).tolist()
PROMPT_B = PROMPT_A[:12] + torch.randint(3, 256, (7,), generator=torch.Generator().manual_seed(2)).tolist()
NUM_SHARED_BLOCKS = 12 // BLOCK_SIZE


class WatchedForward:
    """Wraps ``model.forward``: keeps (positions, logits of every token) of each call."""

    def __init__(self, model):
        self.model, self.forward = model, model.forward
        self.calls = []
        model.forward = self

    def __call__(self, input_ids, positions, attention):
        hidden = self.forward(input_ids, positions, attention)
        self.calls.append((positions.tolist(), self.model.compute_logits(hidden)))
        return hidden


def drive(runner):
    """The schedule in the module doc; returns the scheduler and each step's {req: range}."""
    sched = HandScheduler(runner)
    sched.add("a", PROMPT_A)
    steps = [{"a": 8}, {"a": 13}]
    ranges = [{"a": range(0, 8)}, {"a": range(8, 21)}]
    for step in steps:
        sched.step(step)
    shared = sched.reqs["a"]["blocks"][:NUM_SHARED_BLOCKS]
    sched.add("b", PROMPT_B, shared_blocks=shared, num_computed=NUM_SHARED_BLOCKS * BLOCK_SIZE)
    sched.step({"a": 1, "b": 7})
    ranges.append({"a": range(21, 22), "b": range(12, 19)})
    for i in range(3):
        sched.step({"a": 1, "b": 1})
        ranges.append({"a": range(22 + i, 23 + i), "b": range(19 + i, 20 + i)})
    return sched, ranges


@pytest.mark.parametrize("paths", ["default", "plain"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_runner_logits_match_transformers(case, paths, tmp_path):
    hf = random_hf_model(case)
    hf.save_pretrained(tmp_path)
    model, config = load_hf_model(str(tmp_path))
    watched = WatchedForward(model)
    runner = ModelRunner(model, config, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, dtype=torch.float32,
                         max_num_seqs=4, max_model_len=64,
                         cpu_paths=CpuPaths.plain() if paths == "plain" else None)
    sched, ranges = drive(runner)
    sequences = {r: sched.tokens(r) for r in ("a", "b")}
    expected = {r: hf_logits(hf, tokens) for r, tokens in sequences.items()}
    assert len(watched.calls) == len(ranges)
    for (positions, logits), owners in zip(watched.calls, ranges):
        assert sorted(positions) == sorted(p for span in owners.values() for p in span)
        for row, position in enumerate(positions):
            owner = next(r for r, span in owners.items() if position in span)
            torch.testing.assert_close(logits[row], expected[owner][position], atol=2e-4, rtol=2e-4)
    for r, prompt in (("a", PROMPT_A), ("b", PROMPT_B)):
        greedy = expected[r][len(prompt) - 1:-1].argmax(dim=-1).tolist()
        assert sched.outputs(r) == greedy


def test_gemma_keeps_the_native_attention_kernel(tmp_path):
    """The C kernel caps scores as Gemma 2 does: Gemma 2 and Gemma 3 both keep it where the CPU has it."""
    kernels = {}
    for case in ("gemma2", "gemma3_text"):
        random_hf_model(case).save_pretrained(tmp_path / case)
        model, config = load_hf_model(str(tmp_path / case))
        runner = ModelRunner(model, config, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, dtype=torch.float32,
                             max_num_seqs=4, max_model_len=64)
        kernels[case] = runner.attention_kernel
    if choose_cpu_paths(torch.float32).attention_kernel is not None:
        assert kernels["gemma2"] is not None and kernels["gemma3_text"] is not None


@pytest.mark.parametrize("case", ["gemma2", "gemma3_text"])
def test_triton_attention_refuses_gemma_naming_the_architecture(case, tmp_path):
    random_hf_model(case).save_pretrained(tmp_path)
    model, config = load_hf_model(str(tmp_path))
    with pytest.raises(ValueError, match=f"attention_backend triton: {case} needs .*per-layer sliding windows"):
        ModelRunner(model, config, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, dtype=torch.float32,
                    max_num_seqs=4, max_model_len=64, attention_backend="triton")
