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
# float32 only: a mixture of experts' router product, routing and combining.
MOE_SIGNATURES = {
    "linear_f32": [_PTR, _I64, _I64, _PTR, _I64, _PTR],
    "moe_route_f32": [_PTR, _I64, _I64, _I64, _INT, _PTR, _PTR],
    "moe_combine_f32": [_PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR],
}
# float32 logits: each row's argmax (returns 0, or -2 without memory).
ARGMAX_SIGNATURE = [_PTR, _I64, _I64, _I64, _PTR]


class FusedOps:
    """The library's functions for float32 and bfloat16 CPU tensors."""

    # What a model may ask of it (the GPU twin, ``TritonFusedOps``, has fewer).
    OPERATIONS = frozenset({"rms_norm", "offset_rms_norm", "rotary", "partial_rotary", "head_rms_norm",
                            "silu_mul", "gelu_tanh_mul", "moe_route"})

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}
        for name, argtypes in SIGNATURES.items():
            for dtype, suffix in _SUFFIX.items():
                function = getattr(library, f"{name}_{suffix}")
                function.restype, function.argtypes = None, argtypes
                self._functions[name, dtype] = function
        for name, argtypes in MOE_SIGNATURES.items():
            function = getattr(library, name)
            function.restype, function.argtypes = None, argtypes
            self._functions[name, torch.float32] = function
        self._argmax = library.argmax_rows_f32
        self._argmax.restype, self._argmax.argtypes = _INT, ARGMAX_SIGNATURE

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

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """float32 ``x [T, K] @ weight.T`` -> [T, N] for weight [N, K], each sum in one fixed order
        (the router's product: the one-call decoder computes it with the same function)."""
        _check_float32("linear", x, weight)
        if weight.dim() != 2 or x.dim() != 2 or x.shape[1] != weight.shape[1]:
            raise ValueError(f"linear: x [T, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
        out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
        self._functions["linear_f32", torch.float32](x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(),
                                                     weight.shape[0], out.data_ptr())
        return out

    def moe_route(self, logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits float32 [T, E] -> (weights float32 [T, k], expert ids int64 [T, k]), best first:
        softmax, the k largest (ties: the lower id first), renormalised to sum to 1 with ``normalize``."""
        _check_float32("moe_route", logits)
        if logits.dim() != 2 or not 0 < k <= logits.shape[1]:
            raise ValueError(f"moe_route: logits [T, E] with 0 < k <= E, got {tuple(logits.shape)} and k={k}")
        weights = torch.empty(logits.shape[0], k, dtype=torch.float32)
        ids = torch.empty(logits.shape[0], k, dtype=torch.int64)
        self._functions["moe_route_f32", torch.float32](logits.data_ptr(), logits.shape[0], logits.shape[1], k,
                                                        int(normalize), weights.data_ptr(), ids.data_ptr())
        return weights, ids

    def moe_combine(self, outs: torch.Tensor, pair_rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """out [T, H]: row t = sum over j < k, in order, of ``weights[t, j] * outs[pair_rows[t, j]]``
        (outs float32 [pairs, H]: each (token, expert) pair's expert output; pair_rows int64 [T, k])."""
        _check_float32("moe_combine", outs, weights)
        if pair_rows.dtype != torch.int64 or not pair_rows.is_contiguous() or pair_rows.shape != weights.shape \
                or outs.dim() != 2 or pair_rows.numel() and not 0 <= int(pair_rows.min()) <= int(pair_rows.max()) \
                < outs.shape[0]:
            raise ValueError(f"moe_combine: pair_rows must be int64 [T, k] rows of outs [{outs.shape[0]}, H], "
                             f"got {pair_rows.dtype} {tuple(pair_rows.shape)}")
        rows, k = weights.shape
        out = torch.empty(rows, outs.shape[1], dtype=torch.float32)
        self._functions["moe_combine_f32", torch.float32](outs.data_ptr(), pair_rows.data_ptr(), weights.data_ptr(),
                                                          rows, k, outs.shape[1], out.data_ptr())
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 [B]: each row's ``logits.argmax(dim=-1)`` for float32 CPU logits [B, V] whose
        rows are contiguous (the first of equal maxima; a row's first NaN if it has one);
        other tensors go to torch.argmax."""
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.device.type != "cpu" \
                or logits.stride(1) != 1 or not logits.shape[0] or not logits.shape[1]:
            return logits.argmax(dim=-1)
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        if self._argmax(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr()):
            raise MemoryError("argmax: no memory for the rows' chunks")
        return out


def _check_float32(name: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name}: tensors must be contiguous float32 on the CPU, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")


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
