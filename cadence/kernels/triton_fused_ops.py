"""The decoder layer's elementwise steps fused in Triton, for the GPU.

The GPU twin of ``cadence.kernels.fused_ops`` (same methods, same
rounding), for the same reason at a different scale: a batch-1 decode of
an 8B model is a few hundred matrix-vector products, and PyTorch's
unfused RMSNorm (five kernels), rotary (ten) and SiLU-mul (two) add about a
thousand tiny kernels per step, each a few microseconds even inside a CUDA
graph. Here each is one kernel:

    rms_norm(x, weight, eps, residual)  residual += x (in place), then weight * norm
    rotary_(q, k, cos, sin)             q and k rotated in place, cos/sin float32 [T, D]
    silu_mul(gate_up)                   silu(gate) * up

Rounding follows the unfused PyTorch code: the residual sum and the norm
are rounded to the tensor's dtype where PyTorch rounds them.
"""

from __future__ import annotations

import functools

import torch

from cadence.kernels.triton_attention import _next_pow2, prepare_interpreter

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    prepare_interpreter()

    @triton.jit
    def add_rms_norm_kernel(x_ptr, stride_x, res_ptr, stride_res, w_ptr, out_ptr, stride_out,
                            width, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < width
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            res = tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0)
            x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
            tl.store(res_ptr + row * stride_res + cols, x, mask=ok)
        xf = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / width + eps)
        normed = (xf * inv).to(x.dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (w * normed).to(x.dtype), mask=ok)

    @triton.jit
    def rotary_kernel(x_ptr, stride_x, num_heads, cos_ptr, sin_ptr,
                      HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BLOCK_HALF)
        heads = tl.arange(0, BLOCK_H)
        j_ok = j < HALF
        table = token * 2 * HALF
        cos1 = tl.load(cos_ptr + table + j, mask=j_ok, other=0.0)[None, :]
        cos2 = tl.load(cos_ptr + table + HALF + j, mask=j_ok, other=0.0)[None, :]
        sin1 = tl.load(sin_ptr + table + j, mask=j_ok, other=0.0)[None, :]
        sin2 = tl.load(sin_ptr + table + HALF + j, mask=j_ok, other=0.0)[None, :]
        ok = (heads < num_heads)[:, None] & j_ok[None, :]
        base = x_ptr + token * stride_x + heads[:, None] * (2 * HALF) + j[None, :]
        x1 = tl.load(base, mask=ok, other=0.0)
        x2 = tl.load(base + HALF, mask=ok, other=0.0)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(base, (f1 * cos1 - f2 * sin1).to(x1.dtype), mask=ok)
        tl.store(base + HALF, (f2 * cos2 + f1 * sin2).to(x1.dtype), mask=ok)

    @triton.jit
    def silu_mul_kernel(gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < width
        gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=ok, other=0.0)
        up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=ok, other=0.0)
        g = gate.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
        tl.store(out_ptr + row * width + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=ok)

    return add_rms_norm_kernel, rotary_kernel, silu_mul_kernel


class TritonFusedOps:
    """``FusedOps``'s methods for tensors on a GPU (or the CPU under Triton's interpreter)."""

    # What a model may ask of it (see ``FusedOps.OPERATIONS``).
    OPERATIONS = frozenset({"rms_norm", "rotary", "silu_mul"})

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in _DTYPES

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``weight * norm(x)`` for x [T, H]; with ``residual``, first ``residual += x``
        (in place) and the sum is normed."""
        for rows in (x, residual):
            if rows is not None and (rows.dim() != 2 or rows.stride(1) != 1):
                raise ValueError(f"rms_norm: rows must be [T, H] with contiguous rows, got {rows.stride()}")
        norm_kernel = _kernels()[0]
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if x.shape[0] == 0:
            return out
        norm_kernel[(x.shape[0],)](
            x, x.stride(0), x if residual is None else residual,
            0 if residual is None else residual.stride(0), weight, out, out.stride(0),
            x.shape[1], eps, HAS_RESIDUAL=residual is not None, BLOCK=_next_pow2(x.shape[1]),
        )
        return out

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by float32 cos/sin [T, D]."""
        num_tokens, head_dim = q.shape[0], q.shape[2]
        for x in (q, k):
            if x.stride(2) != 1 or x.stride(1) != head_dim:
                raise ValueError(f"rotary: heads must be contiguous rows, got strides {x.stride()}")
        for table in (cos, sin):
            if table.dtype != torch.float32 or not table.is_contiguous() or table.shape != (num_tokens, head_dim):
                raise ValueError(f"rotary: cos/sin must be contiguous float32 [{num_tokens}, {head_dim}]")
        if num_tokens == 0:
            return
        rotary_kernel = _kernels()[1]
        half = head_dim // 2
        item = q.element_size()
        if k.data_ptr() == q.data_ptr() + q.shape[1] * head_dim * item and k.stride(0) == q.stride(0):
            # k's heads follow q's in each row (one fused qkv projection): one launch for both.
            q = q.as_strided((num_tokens, q.shape[1] + k.shape[1], head_dim), q.stride())
            pairs = (q,)
        else:
            pairs = (q, k)
        for x in pairs:
            rotary_kernel[(num_tokens,)](
                x, x.stride(0), x.shape[1], cos, sin, HALF=half,
                BLOCK_H=_next_pow2(x.shape[1]), BLOCK_HALF=_next_pow2(half),
            )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` [T, I] from gate_up [T, 2I] (gate the first half of each row)."""
        if not gate_up.is_contiguous() or gate_up.shape[1] % 2:
            raise ValueError(f"silu_mul: gate_up must be contiguous [T, 2I], got {tuple(gate_up.shape)}")
        num_tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(num_tokens, width, dtype=gate_up.dtype, device=gate_up.device)
        if num_tokens == 0:
            return out
        block = min(1024, _next_pow2(width))
        _kernels()[2][(num_tokens, -(-width // block))](gate_up, out, width, BLOCK=block)
        return out
