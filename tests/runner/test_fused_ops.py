"""The C elementwise steps (``fused_ops``) against the PyTorch code they replace."""

import pytest
import torch
import torch.nn.functional as F

from cadence.kernels import build as native
from cadence.kernels import fused_ops as fused_module
from cadence.models.attention_ref import ReferenceAttention
from cadence.models.layers import HeadRMSNorm, RMSNorm
from cadence.models.rotary import apply_rotary
from cadence.models.testing import random_model, tiny_config

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ops():
    library = fused_module.fused_ops()
    if library is None:
        pytest.skip("no C compiler: fused ops unavailable")
    return library


def assert_matches(actual, expected):
    """Equal up to float32 summation order (bfloat16 results may differ by one rounding)."""
    if expected.dtype == torch.bfloat16:
        torch.testing.assert_close(actual.float(), expected.float(), atol=1e-2, rtol=1e-2)
    else:
        torch.testing.assert_close(actual, expected, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 7, 300])  # 300 x 576 rows run on several threads
def test_rms_norm_with_and_without_residual(ops, dtype, num_rows):
    generator = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, 576, generator=generator).to(dtype)
    residual = torch.randn(num_rows, 576, generator=generator).to(dtype)
    norm = RMSNorm(576, 1e-5, dtype=dtype)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(576, generator=generator))
    expected = norm(x)
    expected_pair = norm(x, residual)
    norm.fused_ops = ops
    assert_matches(norm(x), expected)
    stream = residual.clone()
    normed, new_residual = norm(x, stream)
    assert new_residual is stream  # summed in place
    assert torch.equal(new_residual, expected_pair[1])  # one rounded add, as PyTorch's
    assert_matches(normed, expected_pair[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_strided_views(ops, dtype):
    num_tokens, q_heads, kv_heads, head_dim = 5, 4, 2, 16
    qkv = torch.randn(num_tokens, (q_heads + 2 * kv_heads) * head_dim).to(dtype)
    q = qkv[:, : q_heads * head_dim].view(num_tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    v_before = qkv[:, (q_heads + kv_heads) * head_dim :].clone()
    angles = torch.rand(num_tokens, head_dim // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [T, D]
    expected_q = apply_rotary(q, cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1))
    expected_k = apply_rotary(k, cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1))
    ops.rotary_(q, k, cos, sin)
    assert_matches(q, expected_q)
    assert_matches(k, expected_k)
    assert torch.equal(qkv[:, (q_heads + kv_heads) * head_dim :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(ops, dtype):
    gate = torch.linspace(-30, 30, 3 * 40).view(3, 40)
    up = torch.randn(3, 40)
    gate_up = torch.cat([gate, up], dim=1).to(dtype)
    expected = F.silu(gate_up[:, :40]) * gate_up[:, 40:]
    assert_matches(ops.silu_mul(gate_up), expected)


def test_partial_rotary_turns_only_the_first_values_of_each_head(ops):
    num_tokens, q_heads, kv_heads, head_dim, rotary_dim = 3, 4, 2, 16, 8
    qkv = torch.randn(num_tokens, (q_heads + 2 * kv_heads) * head_dim)
    q = qkv[:, : q_heads * head_dim].view(num_tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    angles = torch.rand(num_tokens, rotary_dim // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [T, R]
    expected_q, expected_k = (apply_rotary(x, cos.unsqueeze(1), sin.unsqueeze(1)) for x in (q, k))
    ops.rotary_(q, k, cos, sin)
    assert_matches(q, expected_q)
    assert_matches(k, expected_k)
    assert torch.equal(q[..., rotary_dim:], expected_q[..., rotary_dim:])  # the rest passes through


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("whole", [False, True])
def test_head_norms_in_place_in_the_qkv_rows(ops, dtype, offset, whole):
    """q/k norms per head (Qwen3, Gemma 3) or over the projection (OLMo 2), in
    place in the fused projection's rows; v untouched."""
    num_tokens, heads, head_dim = 5, 4, 16
    qkv = torch.randn(num_tokens, 3 * heads * head_dim).to(dtype)
    q = qkv[:, : heads * head_dim]
    q = q if whole else q.view(num_tokens, heads, head_dim)
    rest = qkv[:, heads * head_dim :].clone()
    norm = HeadRMSNorm(q.shape[-1], 1e-6, dtype=dtype, weight_offset=offset)
    norm.weight.data.copy_(0.1 * torch.randn(q.shape[-1]))
    expected = norm(q.clone())
    norm.fused_ops = ops
    got = norm(q)
    if dtype == torch.bfloat16 and offset:
        assert torch.equal(got, expected)  # Gemma rounds once after the weight: PyTorch's path
        return
    assert got.data_ptr() == q.data_ptr()  # normed where it lies
    assert_matches(q, expected)
    assert torch.equal(qkv[:, heads * head_dim :], rest)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul(ops, dtype):
    gate = torch.linspace(-12, 12, 3 * 40).view(3, 40)
    up = torch.randn(3, 40)
    gate_up = torch.cat([gate, up], dim=1).to(dtype)
    expected = F.gelu(gate_up[:, :40], approximate="tanh") * gate_up[:, 40:]
    assert_matches(ops.gelu_tanh_mul(gate_up), expected)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_offset_norm_in_float32_takes_the_kernel(ops, offset):
    """Gemma's (1 + weight) norm in float32 scales by the offset weight in C; its
    value follows the weight when the weight changes."""
    x = torch.randn(6, 64)
    norm = RMSNorm(64, 1e-6, dtype=torch.float32, weight_offset=offset)
    norm.weight.data.copy_(0.1 * torch.randn(64))
    expected = norm(x)
    norm.fused_ops = ops
    assert_matches(norm(x), expected)
    with torch.no_grad():
        norm.weight.mul_(2)
    norm.fused_ops = None
    expected = norm(x)
    norm.fused_ops = ops
    assert_matches(norm(x), expected)


FAMILIES = {
    "qwen2": dict(architecture="qwen2", attention_bias=True),
    "olmo2": dict(architecture="olmo2", norm_placement="post", qk_norm="whole"),
    "phi3": dict(architecture="phi3", partial_rotary_factor=0.5),
    "gemma3": dict(architecture="gemma3_text", norm_placement="sandwich", norm_weight_offset=1.0,
                   mlp_activation="gelu_tanh", qk_norm="per_head", sliding_rope_theta=10000.0,
                   sliding_window=4, full_attention_layers=(1,), embedding_multiplier=8.0),
    "qwen3_moe": dict(architecture="qwen3_moe", qk_norm="per_head", num_experts=8, num_experts_per_tok=3,
                      moe_intermediate_size=32, dense_mlp_layers=(1,)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_model_matches_pytorch_model(ops, dtype, family):
    config = tiny_config(**FAMILIES[family])
    plain, fused = random_model(config, dtype, seed=2), random_model(config, dtype, seed=2)
    fused.use_fused_ops(ops)
    ids, positions = torch.tensor([5, 17, 42, 99, 3, 250, 7, 64]), torch.arange(8)
    with torch.inference_mode():
        expected = plain.compute_logits(plain(ids, positions, ReferenceAttention()))
        actual = fused.compute_logits(fused(ids, positions, ReferenceAttention()))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual, expected, atol=tolerance, rtol=tolerance)
    fused.use_fused_ops(None)  # and back
    with torch.inference_mode():
        assert torch.equal(fused.compute_logits(fused(ids, positions, ReferenceAttention())), expected)


def test_router_product_matches_pytorch(ops):
    generator = torch.Generator().manual_seed(4)
    x, weight = torch.randn(7, 96, generator=generator), torch.randn(12, 96, generator=generator)
    assert_matches(ops.linear(x, weight), F.linear(x, weight))
    assert torch.equal(ops.linear(x[2:3], weight), ops.linear(x, weight)[2:3])  # a row's sum, whatever the rows


def reference_route(logits, k, normalize):
    """Qwen3-MoE's routing as transformers computes it."""
    weights, ids = F.softmax(logits, dim=-1).topk(k, dim=-1)
    return (weights / weights.sum(dim=-1, keepdim=True) if normalize else weights), ids


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("num_experts,k", [(8, 3), (128, 8), (4, 4)])
def test_routing_matches_softmax_and_topk(ops, normalize, num_experts, k):
    logits = torch.randn(33, num_experts, generator=torch.Generator().manual_seed(num_experts)) * 3
    weights, ids = ops.moe_route(logits, k, normalize)
    expected_weights, expected_ids = reference_route(logits, k, normalize)
    assert ids.dtype == torch.int64 and torch.equal(ids, expected_ids)
    assert_matches(weights, expected_weights)


def test_routing_ties_go_to_the_lower_expert_id(ops):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0], [0.0, 1.0, -1.0, 1.0, 0.0]])
    weights, ids = ops.moe_route(logits, 3, False)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2], [1, 3, 0]]
    assert torch.equal(weights[1], torch.full((3,), 0.2))


def test_combining_sums_each_tokens_picks_in_order(ops):
    generator = torch.Generator().manual_seed(5)
    outs, weights = torch.randn(12, 40, generator=generator), torch.rand(4, 3, generator=generator)
    pair_rows = torch.randperm(12, generator=generator).view(4, 3)
    expected = torch.zeros(4, 40)
    for j in range(3):
        expected += weights[:, j:j + 1] * outs[pair_rows[:, j]]
    assert_matches(ops.moe_combine(outs, pair_rows, weights), expected)
    with pytest.raises(ValueError, match="pair_rows"):
        ops.moe_combine(outs, pair_rows + 1, weights)  # row 12 of 12


def test_moe_layer_with_fused_ops_matches_pytorch(ops):
    config = tiny_config(architecture="qwen3_moe", num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32)
    moe = random_model(config, seed=3).model.layers[0].mlp
    moe.gate.weight.data.mul_(50)  # routing far from uniform
    x = torch.randn(9, config.hidden_size, generator=torch.Generator().manual_seed(6))
    expected = moe(x)
    moe.fused_ops = ops
    assert_matches(moe(x), expected)
    assert torch.equal(moe(x[4:5]), moe(x[4:5]))


def test_rejects_what_it_cannot_read(ops):
    with pytest.raises(ValueError, match="rms_norm"):
        ops.rms_norm(torch.zeros(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="silu_mul"):
        ops.silu_mul(torch.zeros(2, 7))
    q = torch.zeros(2, 4, 8)
    with pytest.raises(ValueError, match="cos/sin"):
        ops.rotary_(q, q, torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, 8))
    assert not ops.supports(torch.float16) and ops.supports(torch.bfloat16)


def test_unavailable_when_native_code_is_disabled(monkeypatch, tmp_path):
    monkeypatch.setenv("CADENCE_NATIVE", "0")
    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path))
    native.load.cache_clear()
    fused_module.fused_ops.cache_clear()
    try:
        assert fused_module.fused_ops() is None
    finally:
        native.load.cache_clear()
        fused_module.fused_ops.cache_clear()


# ------------------------------------------------------------------ argmax
# Each -march reaches one of the kernel's paths: AVX-512 (where the machine has
# it), AVX2 (x86-64-v3), scalar (x86-64-v2).
ARGMAX_BUILDS = ["native", "x86-64-v3", "x86-64-v2"]


def argmax_build(march):
    library = fused_module.fused_ops(march)
    if library is None:
        pytest.skip(f"fused ops do not build for -march={march} here")
    return library


def logits_with(rows, width, seed, ties=False, nans=(), infs=()):
    generator = torch.Generator().manual_seed(seed)
    if ties:  # few distinct values: many equal maxima, across chunks too
        logits = torch.randint(0, 3, (rows, width), generator=generator).float()
    else:
        logits = torch.randn(rows, width, generator=generator)
    for row, column, value in [*((r, c, float("nan")) for r, c in nans), *infs]:
        logits[row, column] = value
    return logits


@pytest.mark.parametrize("march", ARGMAX_BUILDS)
@pytest.mark.parametrize("rows, width", [(1, 1), (1, 17), (3, 49_152), (1, 262_144), (5, 16_385), (2, 40_000)])
def test_argmax_is_torchs(march, rows, width):
    ops = argmax_build(march)
    for seed, ties in ((rows * width, False), (7, True)):
        logits = logits_with(rows, width, seed, ties=ties)
        assert torch.equal(ops.argmax(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("march", ARGMAX_BUILDS)
def test_argmax_takes_the_first_nan_the_first_of_equal_maxima_and_minus_infinity_rows(march):
    ops = argmax_build(march)
    width = 40_000  # three chunks
    logits = logits_with(4, width, 3, nans=[(0, 35_000), (0, 30_001), (1, width - 1)],
                         infs=[(2, 20_000, float("inf")), (2, 39_000, float("inf"))])
    logits[3] = float("-inf")
    expected = logits.argmax(dim=-1)
    assert expected.tolist() == [30_001, width - 1, 20_000, 0]
    assert torch.equal(ops.argmax(logits), expected)
    zeros = torch.zeros(1, 100)
    zeros[0, 3] = -0.0  # equal to 0.0: the first index wins
    assert ops.argmax(zeros).tolist() == zeros.argmax(dim=-1).tolist() == [0]


def test_argmax_reads_strided_rows_and_hands_other_tensors_to_torch(ops):
    wide = logits_with(4, 50_000, 11)
    rows = wide[:, 7:45_000]  # row stride 50,000: read in place
    assert torch.equal(ops.argmax(rows), rows.argmax(dim=-1))
    for other in (wide.t(), wide.double(), wide[0]):  # columns strided, float64, one dimension
        assert torch.equal(ops.argmax(other), other.argmax(dim=-1))


def test_the_cpu_runner_samples_greedy_rows_with_the_c_argmax(ops):
    from cadence.runner.model_runner import ModelRunner
    from cadence.runner.sampler import Sampler

    model = random_model(tiny_config(), seed=0)
    runner = ModelRunner(model, model.config, block_size=16, num_blocks=32, dtype=torch.float32,
                         max_num_seqs=4, max_model_len=128)
    fused = runner.cpu_paths.fused_ops
    if fused is None:  # C kernels hidden (CADENCE_HIDE_CPU_FEATURES): PyTorch's argmax
        assert runner.sampler.argmax is Sampler().argmax
    else:
        assert runner.sampler.argmax == fused.argmax
