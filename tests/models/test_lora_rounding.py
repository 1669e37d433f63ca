"""An adapter's delta is rounded the same way whatever shares the batch: a
row's output under bfloat16 is bit-equal alone (one adapter for all rows) and
beside rows of the base model and of another adapter."""

import torch

from cadence.models.lora_layers import LinearLoRA, LoRAMapping


def _layer(mapping: LoRAMapping) -> LinearLoRA:
    gen = torch.Generator().manual_seed(0)
    layer = LinearLoRA(64, (96,), mapping)
    for adapter_id in (1, 2):
        a = torch.randn(8, 64, generator=gen).to(torch.bfloat16)
        b = torch.randn(96, 8, generator=gen).to(torch.bfloat16)
        layer.add(adapter_id, {0: (a, b)}, scaling=0.5)
    return layer


def test_a_row_gets_the_same_bits_alone_and_in_a_mixed_batch():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 64, generator=gen).to(torch.bfloat16)
    base = torch.randn(6, 96, generator=gen).to(torch.bfloat16)
    mapping = LoRAMapping()
    layer = _layer(mapping)
    mapping.update(torch.tensor([1, 0, 2, 1, 0, 2]))
    mixed = layer.apply(x, base.clone())
    for row in (0, 3):  # adapter 1's rows, each alone
        mapping.update(torch.tensor([1]))
        assert mapping.all_rows
        alone = layer.apply(x[row:row + 1], base[row:row + 1].clone())
        assert torch.equal(alone[0], mixed[row])
