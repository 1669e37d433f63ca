"""Matmul weights pre-packed into oneDNN's blocked layout, for the CPU.

``F.linear`` on CPU hands float32 to MKL's sgemm, which repacks the weight
on every call and runs a 64-row decode step at 80-140 GFLOP/s on this
project's machines; oneDNN with the weight packed once at load runs the
same products 1.3-2x faster (the 49,152-row LM head of SmolLM2: 38 ms ->
18 ms in float32; 12 -> 10 ms in bfloat16). Results agree with
``F.linear`` to float rounding (a different summation order).

    pack_model(model)    # after loading: every Linear and the LM head

A packed ``Linear`` keeps only the packed copy (``weight`` becomes an empty
placeholder).

Whether a dtype can be packed is probed, never assumed: oneDNN packs
bfloat16 only on CPUs with AVX-512 BW/VL/DQ or AVX-NE-CONVERT (x86) or BF16
(ARM), and raises on the others. ``packing_works`` checks the CPU's visible
flags (``cadence.cpu_features``, so the suite can hide them) and then makes
one trial pack and product per dtype, once per process.
"""

from __future__ import annotations

import functools

import torch

from cadence import cpu_features
from cadence.cpu_features import CpuFeatures

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def packing_works(dtype: torch.dtype, features: CpuFeatures | None = None) -> bool:
    """Whether weights of ``dtype`` can be packed on this CPU (as ``features`` shows it)."""
    features = cpu_features.detect() if features is None else features
    if dtype not in PACKABLE_DTYPES or not features.allows("onednn"):
        return False
    if dtype == torch.bfloat16 and not features.onednn_bf16:
        return False
    return _trial_pack(dtype)


def why_not_packed(dtype: torch.dtype, features: CpuFeatures) -> str:
    """The reason ``packing_works`` says no, for the start-up log line."""
    if dtype not in PACKABLE_DTYPES:
        return f"oneDNN packing is not used for {_name(dtype)}"
    if not features.allows("onednn"):
        return "oneDNN packing hidden"
    if dtype == torch.bfloat16 and not features.onednn_bf16:
        return "oneDNN bfloat16 needs AVX-512 BW/VL/DQ, AVX-NE-CONVERT or ARM BF16"
    return "oneDNN packing failed its trial on this torch build"


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can be packed (a CPU matrix of a dtype packing works for)."""
    return weight.device.type == "cpu" and weight.dim() == 2 and packing_works(weight.dtype)


@functools.cache
def _trial_pack(dtype: torch.dtype) -> bool:
    """One small pack and product; False where this torch build or CPU refuses."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.ones(8, 16, dtype=dtype)
        out = packed_linear(torch.ones(2, 16, dtype=dtype), pack(weight), None)
    except RuntimeError:
        return False
    return bool(torch.all(out == 16))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of ``weight`` [out, in] (an opaque ``torch._mkldnn`` tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for x [..., in] with W packed by ``pack``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")
