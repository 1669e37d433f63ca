"""The Triton fused ops against the PyTorch code they replace (same rounding)."""

from __future__ import annotations

import pytest
import torch

from cadence.kernels.triton_fused_ops import TritonFusedOps
from cadence.models.layers import GatedMLP, RMSNorm
from cadence.models.rotary import apply_rotary

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}  # 1-2 ulps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_pytorch(dtype, with_residual, device):
    torch.manual_seed(0)
    hidden = 96
    norm = RMSNorm(hidden, 1e-5, dtype=dtype).to(device)
    norm.weight.data.normal_(1.0, 0.1)
    x = torch.randn(7, hidden, device=device).to(dtype)
    residual = torch.randn(7, hidden, device=device).to(dtype) if with_residual else None
    if with_residual:
        expected, expected_residual = norm(x, residual.clone())
    else:
        expected = norm(x)
    got = TritonFusedOps().rms_norm(x, norm.weight, 1e-5, residual)
    torch.testing.assert_close(got, expected, atol=TOL[dtype], rtol=TOL[dtype])
    if with_residual:
        torch.testing.assert_close(residual, expected_residual)  # updated in place


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_matches_pytorch(dtype, device):
    torch.manual_seed(1)
    num_tokens, num_heads, num_kv_heads, head_dim = 5, 6, 2, 16
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=device).to(dtype)
    q, k, _ = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    q, k = q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim)
    angles = torch.randn(num_tokens, head_dim // 2, device=device)
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)
    expected_q = apply_rotary(q.float(), cos[:, None], sin[:, None]).to(dtype)
    expected_k = apply_rotary(k.float(), cos[:, None], sin[:, None]).to(dtype)
    TritonFusedOps().rotary_(q, k, cos, sin)
    torch.testing.assert_close(q, expected_q, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(k, expected_k, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_pytorch(dtype, device):
    torch.manual_seed(2)
    gate_up = torch.randn(4, 2 * 80, device=device).to(dtype)
    gate, up = gate_up.split(80, -1)
    expected = torch.nn.functional.silu(gate) * up
    got = TritonFusedOps().silu_mul(gate_up)
    torch.testing.assert_close(got, expected, atol=TOL[dtype], rtol=TOL[dtype])
    assert GatedMLP  # the module whose forward this replaces


def test_rotary_of_separate_q_and_k(device):
    """q and k not adjacent in one qkv row: two launches, same result."""
    torch.manual_seed(3)
    q = torch.randn(3, 4, 8, device=device)
    k = torch.randn(3, 2, 8, device=device)
    angles = torch.randn(3, 4, device=device)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    expected_q, expected_k = apply_rotary(q, cos[:, None], sin[:, None]), apply_rotary(k, cos[:, None], sin[:, None])
    TritonFusedOps().rotary_(q, k, cos, sin)
    torch.testing.assert_close(q, expected_q)
    torch.testing.assert_close(k, expected_k)
