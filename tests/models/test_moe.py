"""Routed experts kept in their GGUF blocks: loaded per expert, computed on the blocks.

A Qwen3-MoE GGUF whose stacked expert tensors are Q8_0 (llama.cpp's
reference quantizer) loads with every expert's matrices as its run of
block rows; its logits equal those of the same file dequantized at load,
up to the products' rounding of activations, with the C kernel and fused
ops or in PyTorch.
"""

import pytest
import torch
from gguf import GGMLQuantizationType as GGMLType

from cadence.kernels.fused_ops import fused_ops
from cadence.kernels.quant_matmul import quant_matmul
from cadence.models.attention_ref import ReferenceAttention
from cadence.models.gguf_loader import load_gguf_model, read_gguf
from cadence.models.quantized import QuantizedTensor
from tests.models.arch_cases import random_hf_model, write_gguf

EXPERT_TYPES = {"ffn_gate_exps": GGMLType.Q8_0, "ffn_up_exps": GGMLType.Q8_0, "ffn_down_exps": GGMLType.Q8_0}
IDS, POSITIONS = torch.tensor([5, 17, 42, 99, 3, 250, 7, 64, 12, 200]), torch.arange(10)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "experts-q8_0.gguf"
    hf = random_hf_model("qwen3_moe")
    for name, param in hf.named_parameters():  # experts that matter beside the residual stream
        if ".experts." in name:
            param.data.mul_(20)
    write_gguf(path, hf, "qwen3moe", EXPERT_TYPES)
    return str(path)


def logits(model):
    with torch.inference_mode():
        return model.compute_logits(model(IDS, POSITIONS, ReferenceAttention.for_model(model.config)))


def test_quantized_experts_stay_in_their_blocks(gguf_path):
    model, config = load_gguf_model(*read_gguf(gguf_path), quantization="auto")
    assert model.dequantized_at_load == {}
    for layer in model.model.layers:
        experts = layer.mlp.experts
        assert experts.gate_up_proj.numel() == experts.down_proj.numel() == 0  # no float copy
        for gate_up, down in zip(experts.gate_up_parts, experts.down_parts):
            (gate_up,), (down,) = gate_up, down  # gate and up are one Q8_0 part
            assert isinstance(gate_up, QuantizedTensor) and gate_up.ggml_type == GGMLType.Q8_0
            assert gate_up.shape == (2 * config.moe_intermediate_size, config.hidden_size)
            assert down.shape == (config.hidden_size, config.moe_intermediate_size)
    parts = model.quantized_weights()
    assert len(parts) == config.num_hidden_layers * config.num_experts * 2  # the rest of the file is float32


def test_expert_rows_are_the_files_rows(gguf_path):
    quantized, _ = load_gguf_model(*read_gguf(gguf_path), quantization="auto")
    dequantized, _ = load_gguf_model(*read_gguf(gguf_path), quantization="none")
    kept, stacked = quantized.model.layers[2].mlp.experts, dequantized.model.layers[2].mlp.experts
    for e in (0, 5, 7):
        assert torch.equal(kept.gate_up_parts[e][0].dequantize(), stacked.gate_up_proj[e])
        assert torch.equal(kept.down_parts[e][0].dequantize(), stacked.down_proj[e])


@pytest.mark.parametrize("kernels", ["pytorch", "c"])
def test_logits_equal_the_dequantized_file(gguf_path, kernels):
    model, _ = load_gguf_model(*read_gguf(gguf_path), quantization="auto")
    reference, _ = load_gguf_model(*read_gguf(gguf_path), quantization="none")
    if kernels == "c":
        ops, kernel = fused_ops(), quant_matmul()
        if ops is None or kernel is None:
            pytest.skip("no C compiler here")
        model.use_fused_ops(ops)
        model.use_quant_kernel(kernel)
    expected = logits(reference)
    torch.testing.assert_close(logits(model), expected, atol=2e-3, rtol=1e-3)
    assert (logits(model) - expected).abs().max() > 0  # the experts did run on the blocks


def test_the_load_plan_sees_the_experts_blocks(gguf_path):
    """dtype="auto" decides from whether blocks are kept: experts alone count."""
    from cadence.runner import load_plan

    assert load_plan.keeps_gguf_blocks(gguf_path, "auto")
    assert not load_plan.keeps_gguf_blocks(gguf_path, "none")
