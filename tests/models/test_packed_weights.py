"""oneDNN-packed matmul weights compute what the dense ones do."""

import pytest
import torch

from cadence import cpu_features
from cadence.kernels import packed_weights
from cadence.models.attention_ref import ReferenceAttention
from cadence.models.layers import Linear
from cadence.models.testing import random_model, tiny_config

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")

IDS = [5, 17, 42, 99, 3, 250, 7, 64]


def logits_of(model, ids):
    positions = torch.arange(len(ids))
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), positions, ReferenceAttention()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [False, True])
def test_packed_model_matches_dense(dtype, tied):
    config = tiny_config(architecture="qwen2", attention_bias=True, tie_word_embeddings=tied)
    dense = random_model(config, dtype, seed=5)
    packed = random_model(config, dtype, seed=5)
    num_linears = sum(isinstance(m, Linear) for m in packed.modules())
    # 2 layers x (qkv, o, gate_up, down), plus the LM head: its own Linear or the tied copy.
    assert num_linears == 8 + (0 if tied else 1)
    # Where this CPU cannot pack the dtype (bfloat16 without AVX-512 BW/VL/DQ),
    # nothing is packed and the dense path computes the same.
    expected_packed = 9 if packed_weights.packing_works(dtype) else 0
    assert packed.pack_weights() == expected_packed
    expected, actual = logits_of(dense, IDS), logits_of(packed, IDS)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual, expected, atol=tolerance, rtol=tolerance)
    assert actual.argmax(-1).tolist() == expected.argmax(-1).tolist()


def test_packing_follows_the_visible_cpu_features():
    features = cpu_features.detect()
    assert not packed_weights.packing_works(torch.float16, features)
    assert not packed_weights.packing_works(torch.float32, cpu_features.with_hidden(features, "onednn"))
    assert not packed_weights.packing_works(torch.bfloat16, cpu_features.with_hidden(features, "avx512", "avx_ne_convert"))
    # bfloat16 is packed only where oneDNN supports it here *and* the trial passed.
    assert packed_weights.packing_works(torch.bfloat16, features) == (
        features.onednn_bf16 and packed_weights._trial_pack(torch.bfloat16))
    if features.allows("onednn"):
        assert "AVX-512" in packed_weights.why_not_packed(
            torch.bfloat16, cpu_features.with_hidden(features, "avx512", "avx_ne_convert", "bf16"))
    else:
        assert packed_weights.why_not_packed(torch.float32, features) == "oneDNN packing hidden"


def test_a_model_packs_nothing_where_the_probe_says_no(monkeypatch):
    real = cpu_features.detect()
    monkeypatch.setattr(cpu_features, "detect", lambda: cpu_features.with_hidden(real, "onednn"))
    model = random_model(tiny_config(), seed=1)
    assert model.pack_weights() == 0
    assert model.model.layers[0].mlp.down_proj.packed_weight is None


needs_fp32_packing = pytest.mark.skipif(
    not packed_weights.packing_works(torch.float32),
    reason="float32 packing unavailable or hidden (CADENCE_HIDE_CPU_FEATURES=onednn)")


@needs_fp32_packing
def test_packing_drops_the_dense_copy_and_is_idempotent():
    model = random_model(tiny_config(), seed=1)
    proj = model.model.layers[0].mlp.down_proj
    dense_weight = proj.weight.detach().clone()
    x = torch.randn(3, dense_weight.shape[1])
    expected = x @ dense_weight.T
    assert model.pack_weights() == 9
    assert proj.weight.numel() == 0 and proj.packed_weight is not None
    assert model.pack_weights() == 0  # nothing left to pack
    torch.testing.assert_close(proj(x), expected, atol=1e-5, rtol=1e-5)
    # The embedding keeps its dense table (lookups), whatever the head does.
    assert model.model.embed_tokens.weight.shape == (256, 64)


@needs_fp32_packing
def test_packed_linear_takes_any_leading_shape_and_empty_batches():
    linear = Linear(16, 8, bias=True, dtype=torch.float32)
    torch.nn.init.normal_(linear.weight)
    torch.nn.init.normal_(linear.bias)
    weight, bias = linear.weight.detach().clone(), linear.bias.detach().clone()
    assert linear.pack()
    for shape in [(0, 16), (5, 16), (2, 3, 16)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, weight, bias), atol=1e-5, rtol=1e-5)


def test_what_cannot_be_packed():
    assert not packed_weights.can_pack(torch.zeros(4, 4, dtype=torch.float16))
    assert not packed_weights.can_pack(torch.zeros(4))
    linear = Linear(4, 4, bias=False, dtype=torch.float16)
    assert not linear.pack() and linear.packed_weight is None and linear.weight.shape == (4, 4)
