"""A long prefill's feed-forward on the CPU runs in slices of rows (GatedMLP.row_slice,
which the runner sets to MLP_ROW_SLICE on the CPU)."""

from __future__ import annotations

import pytest
import torch

from cadence.models.layers import GatedMLP, slice_feed_forwards
from cadence.models.lora_layers import LinearLoRA, LoRAMapping
from cadence.models.testing import random_model, tiny_config
from cadence.runner.model_runner import MLP_ROW_SLICE, ModelRunner


def random_mlp(hidden=16, intermediate=24, seed=0, row_slice=8):
    torch.manual_seed(seed)
    mlp = GatedMLP(hidden, intermediate, dtype=torch.float32)
    for param in mlp.parameters():
        param.data.normal_(0, 0.2)
    slice_feed_forwards(mlp, row_slice)
    return mlp


def slice_rows(mlp):
    """Record the row count of every slice ``mlp`` computes."""
    seen, rows = [], mlp._rows
    mlp._rows = lambda x: (seen.append(x.shape[0]), rows(x))[1]
    return seen


@pytest.mark.parametrize("num_rows, slices", [(8, [8]), (9, [5, 4]), (17, [6, 6, 5]), (24, [8, 8, 8])])
def test_rows_past_the_slice_run_in_even_slices_with_the_same_values(num_rows, slices):
    mlp = random_mlp()
    x = torch.randn(num_rows, 16)
    whole = torch.cat([mlp._rows(row[None]) for row in x])  # each row alone
    seen = slice_rows(mlp)
    out = mlp(x)
    assert seen == slices  # even slices: no short last slice on another product path
    torch.testing.assert_close(out, whole, rtol=1e-6, atol=1e-6)


def test_rows_with_a_lora_adapter_are_not_sliced():
    """An adapter's mapping indexes the step's whole batch: those rows go through at once."""
    mlp = random_mlp()
    mapping = LoRAMapping()
    mlp.gate_up_proj.lora = LinearLoRA(16, (24, 24), mapping)
    seen = slice_rows(mlp)
    mlp(torch.randn(20, 16))
    assert seen == [7, 7, 6]  # no adapter's row in this step: sliced
    seen.clear()
    mapping.update(torch.tensor([0] * 10 + [3] * 10))  # rows of adapter 3
    mlp.gate_up_proj.lora.add(3, {0: (torch.randn(2, 16), torch.randn(24, 2))}, scaling=1.0)
    mlp(torch.randn(20, 16))
    assert seen == [20]


def test_without_a_slice_every_row_goes_at_once():
    mlp = random_mlp(row_slice=None)
    seen = slice_rows(mlp)
    mlp(torch.randn(2000, 16))
    assert seen == [2000]


def test_the_cpu_runner_slices_its_models_feed_forwards():
    model = random_model(tiny_config(), seed=0)
    assert {m.row_slice for m in model.modules() if isinstance(m, GatedMLP)} == {None}
    runner = ModelRunner(model, model.config, block_size=4, num_blocks=8, dtype=torch.float32,
                         max_num_seqs=2, max_model_len=32)
    assert {m.row_slice for m in runner.model.modules() if isinstance(m, GatedMLP)} == {MLP_ROW_SLICE}
