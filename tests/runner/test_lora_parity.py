"""LoRA on a mixed batch equals PEFT's merged models, row by row.

One forward holds four sequences: the base model, adapter 1, adapter 2 and
adapter 1 again. Each sequence's logits must equal those of the model with
its adapter merged into the weights (``merge_and_unload``), or of the base
model for the row without one.
"""

import pytest
import torch

from cadence.config import LoRAConfig
from cadence.core.request import LoRARequest
from cadence.models.hf_loader import load_hf_model
from cadence.models.lora_layers import LoRAMapping
from cadence.runner.lora import LoRAManager
from tests.models.test_llama_decoder import PackedAttention
from tests.runner.lora_helpers import hf_logits, merged_model, save_adapter, save_base

import numpy as np

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [40, 41, 42, 43, 44, 45], [10, 11, 12, 13]]
SEQ_LORAS = [0, 1, 2, 1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = save_base(root / "base")
    save_adapter(base, root / "a1", seed=1, rank=8, alpha=16)
    save_adapter(base, root / "a2", seed=2, rank=4, alpha=8, use_rslora=True,
                 targets=["q_proj", "v_proj", "down_proj"])
    return root, base


def cadence_mixed_logits(root, dtype=torch.float32):
    model, _ = load_hf_model(str(root / "base"), dtype)
    manager = LoRAManager(model, LoRAConfig(enable_lora=True, max_loras=2), dtype,
                          torch.device("cpu"))
    manager.add_lora(LoRARequest("a1", 1, str(root / "a1")))
    manager.add_lora(LoRARequest("a2", 2, str(root / "a2")))
    lengths = [len(p) for p in PROMPTS]
    manager.set_step(np.array(SEQ_LORAS), np.array(lengths))
    attention = PackedAttention(len(PROMPTS))
    attention.lengths = lengths
    ids = torch.tensor([t for p in PROMPTS for t in p])
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, positions, attention))
    return logits.split(lengths)


def test_mixed_batch_rows_equal_merged_models(setup):
    root, base = setup
    expected_models = {0: base, 1: merged_model(base, root / "a1"), 2: merged_model(base, root / "a2")}
    rows = cadence_mixed_logits(root)
    for prompt, lora_id, got in zip(PROMPTS, SEQ_LORAS, rows):
        expected = hf_logits(expected_models[lora_id], prompt)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # The adapters matter: adapter 1's rows are not the base model's.
    assert (rows[1] - hf_logits(base, PROMPTS[1])).abs().max() > 1e-2


def test_bfloat16_tracks_float32(setup):
    root, _ = setup
    full = cadence_mixed_logits(root)
    half = cadence_mixed_logits(root, torch.bfloat16)
    for f, h in zip(full, half):
        assert (f - h).abs().max() < 0.05 * f.abs().max()


def test_mapping_groups_rows_by_adapter():
    mapping = LoRAMapping()
    mapping.update(torch.tensor([0, 7, 7, 3, 0, 3, 7]))
    assert mapping.token_rows.tolist() == [3, 5, 1, 2, 6]
    assert mapping.segments == [(3, 0, 2), (7, 2, 5)]
    assert not mapping.all_rows
    mapping.update(torch.tensor([4, 4]))
    assert mapping.all_rows and mapping.segments == [(4, 0, 2)]
    mapping.update(torch.tensor([0, 0]))
    assert mapping.token_rows is None
