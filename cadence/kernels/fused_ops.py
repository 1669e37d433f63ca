"""The decoder layer's elementwise steps fused in C, for the CPU (``cadence/kernels/csrc/fused_ops.c``).

At a 64-row decode step PyTorch spends more on dispatching RMSNorm (four
kernels), rotary (six) and SiLU-mul (two) than on their arithmetic; each
function here is one pass over its rows, rounding where PyTorch rounds.
A model uses them after ``LlamaForCausalLM.use_fused_ops(fused_ops())``;
``fused_ops()`` is None where the library cannot be built (see
``cadence.kernels.build``), and the model keeps its PyTorch code.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from cadence.kernels import build

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_PTR, _I64, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "add_rms_norm": [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _FLOAT],
    "rotary": [_PTR, _I64, _INT, _PTR, _I64, _INT, _PTR, _PTR, _I64, _INT, _INT],
    "head_rms_norm": [_PTR, _I64, _I64, _I64, _PTR, _I64, _FLOAT],
    "silu_mul": [_PTR, _PTR, _I64, _I64],
    "gelu_tanh_mul": [_PTR, _PTR, _I64, _I64],
}


class FusedOps:
    """The library's functions for float32 and bfloat16 CPU tensors."""

    # What a model may ask of it (the GPU twin, ``TritonFusedOps``, has fewer).
    OPERATIONS = frozenset({"rms_norm", "offset_rms_norm", "rotary", "partial_rotary", "head_rms_norm",
                            "silu_mul", "gelu_tanh_mul"})

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}
        for name, argtypes in SIGNATURES.items():
            for dtype, suffix in _SUFFIX.items():
                function = getattr(library, f"{name}_{suffix}")
                function.restype, function.argtypes = None, argtypes
                self._functions[name, dtype] = function

    def supports(self, dtype: torch.dtype) -> bool:
        """Whether CPU tensors of ``dtype`` can go through these functions."""
        return dtype in _SUFFIX

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``weight * norm(x)`` for x [T, H]; with ``residual``, first ``residual += x``
        (in place) and the sum is normed."""
        _check_rows(x, weight)
        out = torch.empty(x.shape, dtype=x.dtype)
        if residual is not None:
            _check_rows(residual, weight)
        self._functions["add_rms_norm", x.dtype](
            x.data_ptr(), x.stride(0),
            None if residual is None else residual.data_ptr(),
            0 if residual is None else residual.stride(0),
            weight.data_ptr(), out.data_ptr(), out.stride(0), x.shape[0], x.shape[1], eps,
        )
        return out

    def rotary_(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by float32 cos/sin [T, R]:
        the first R values of each head (R = D but for partial rotary).

        q and k may be row-strided views (of one fused qkv projection); each
        row's heads must be contiguous.
        """
        num_tokens, head_dim = q.shape[0], q.shape[2]
        rotary_dim = cos.shape[-1]
        for x in (q, k):
            if x.dtype != q.dtype or x.stride(2) != 1 or x.stride(1) != head_dim:
                raise ValueError(f"rotary: heads must be contiguous rows, got strides {x.stride()}")
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary: cos/sin rows of {rotary_dim} do not turn heads of {head_dim}")
        for table in (cos, sin):
            if table.dtype != torch.float32 or not table.is_contiguous() or table.shape != (num_tokens, rotary_dim):
                raise ValueError(f"rotary: cos/sin must be contiguous float32 [{num_tokens}, {rotary_dim}]")
        self._functions["rotary", q.dtype](
            q.data_ptr(), q.stride(0), q.shape[1], k.data_ptr(), k.stride(0), k.shape[1],
            cos.data_ptr(), sin.data_ptr(), num_tokens, head_dim, rotary_dim,
        )

    def head_rms_norm_(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """``x = weight * norm(x)`` in place over the last dimension of x [T, H, D]
        (a row-strided view, each row's heads contiguous); weight [D]."""
        num_tokens, heads, width = x.shape
        if x.stride(2) != 1 or x.stride(1) != width or x.dtype != weight.dtype \
                or weight.shape != (width,) or not weight.is_contiguous():
            raise ValueError(f"head_rms_norm: x must be [T, H, {weight.shape[0]}] contiguous heads of "
                             f"{weight.dtype}, got {x.dtype} {tuple(x.shape)} strides {x.stride()}")
        self._functions["head_rms_norm", x.dtype](x.data_ptr(), x.stride(0), heads, width, weight.data_ptr(),
                                                  num_tokens, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` [T, I] from gate_up [T, 2I] (gate the first half of each row)."""
        return self._gated("silu_mul", gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu_tanh(gate) * up`` [T, I] from gate_up [T, 2I] (gate the first half of each row)."""
        return self._gated("gelu_tanh_mul", gate_up)

    def _gated(self, name: str, gate_up: torch.Tensor) -> torch.Tensor:
        if not gate_up.is_contiguous() or gate_up.shape[1] % 2:
            raise ValueError(f"{name}: gate_up must be contiguous [T, 2I], got {tuple(gate_up.shape)}")
        num_tokens, width = gate_up.shape
        out = torch.empty(num_tokens, width // 2, dtype=gate_up.dtype)
        self._functions[name, gate_up.dtype](gate_up.data_ptr(), out.data_ptr(), num_tokens, width // 2)
        return out


def _check_rows(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype != weight.dtype or x.shape[1] != weight.shape[0] \
            or not weight.is_contiguous():
        raise ValueError(f"rms_norm: x must be [T, {weight.shape[0]}] rows of {weight.dtype}, "
                         f"got {x.dtype} {tuple(x.shape)} strides {x.stride()}")


@functools.cache
def fused_ops(march: str = "native") -> FusedOps | None:
    """The compiled functions, or None (no compiler, build failed, or CADENCE_NATIVE=0)."""
    library = build.load("fused_ops", march)
    return None if library is None else FusedOps(library)
