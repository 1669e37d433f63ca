"""Which dtype and which fast paths this machine runs, decided once at start.

Nothing is assumed about the CPU: each fast path is taken only where the
probe (``cadence.cpu_features`` flags, then a trial call) says it works, and
the plain PyTorch path is kept otherwise. The choice is logged in one line:

    cadence: CPU AMD EPYC (x86_64; avx2 fma), float32: oneDNN packed matmuls,
             C kernels (-march=native)

    fast path            taken when
    oneDNN packed        oneDNN packs this dtype here (bfloat16: AVX-512 BW/VL/DQ,
    matmuls              AVX-NE-CONVERT or ARM BF16) and a trial product agrees
    C kernels            a C compiler builds them (float32 and bfloat16 only)
    quantized matmuls    the C kernel on GGUF blocks builds (AVX2 FMA where -march has
                         them, portable C otherwise); else PyTorch dequantizes per call
    decoder stack        both of the above: a decode step's layers in one C call
                         (the runner also checks the model, ``cadence.runner.fused_decoder``)

``resolve_quantization`` turns the ``quantization`` option into what the
loader does: ``auto`` keeps GGUF blocks only on a CPU where that kernel builds.

``dtype="auto"`` is the fastest measured for the loaded model on this CPU:

    weights                             auto     why
    GGUF blocks kept (quantization      float32  the quantized products and the one-call
    auto/gguf keeps a matmul weight)             decoder take float32 activations; bfloat16
                                                 was slower even where native (issue 31:
                                                 113-119 against 201-219 tok/s single stream)
    floats (HF folder, float GGUF,      bfloat16 where the CPU computes it natively (AVX512_BF16,
    quantization none)                  float32  AMX, ARM BF16), float32 elsewhere

``CADENCE_RESOLVE_AS`` (``cadence.cpu_features``) makes the second row read
another machine kind. On a GPU ``auto`` is the checkpoint's own dtype
(float32 checkpoints run in bfloat16 where the GPU has it, else float16).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

import torch

from cadence import cpu_features
from cadence.cpu_features import CpuFeatures
from cadence.kernels import packed_weights

if TYPE_CHECKING:
    from cadence.kernels.fused_ops import FusedOps
    from cadence.kernels.paged_attention import PagedAttentionKernel
    from cadence.kernels.quant_matmul import QuantMatmul

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Flags with which a CPU computes float16 products natively.
_FP16_FLAGS = ("avx512_fp16", "amx_fp16", "fphp", "asimdhp")


@dataclass(frozen=True)
class CpuPaths:
    """The fast paths one model runs on the CPU, and why each was or was not taken."""

    pack_weights: bool
    fused_ops: "FusedOps | None"
    attention_kernel: "PagedAttentionKernel | None"
    reasons: tuple[str, ...] = ()  # one entry per path, for the log line
    quant_matmul: "QuantMatmul | None" = None  # products on quantized weights (None: PyTorch)
    quant_reason: str = "quantized matmuls in PyTorch (dequantized per call)"
    # -march of the C loop through all decoder layers of a decode step, built when a
    # model can use it (see cadence.runner.fused_decoder); None: its kernels are unavailable.
    decoder_stack_arch: str | None = None

    @classmethod
    def plain(cls) -> "CpuPaths":
        """Plain PyTorch throughout."""
        return cls(False, None, None, ("plain PyTorch by request",))

    def describe(self) -> str:
        return "; ".join(self.reasons)


def choose_cpu_paths(dtype: torch.dtype, features: CpuFeatures | None = None) -> CpuPaths:
    """The fast paths ``dtype`` can take on this CPU, as ``features`` shows it."""
    features = cpu_features.detect() if features is None else features
    reasons = []
    pack = packed_weights.packing_works(dtype, features)
    reasons.append("oneDNN packed matmuls" if pack else
                   f"PyTorch matmuls ({packed_weights.why_not_packed(dtype, features)})")
    fused, attention, why_not = _native_kernels(dtype, features)
    march = features.compiler_arch()
    reasons.append(f"C kernels (-march={march})" if why_not is None else f"PyTorch kernels ({why_not})")
    quant, quant_reason = quant_kernel(features)
    stack_arch = march if fused is not None and quant is not None else None
    return CpuPaths(pack, fused, attention, tuple(reasons), quant, quant_reason, stack_arch)


def quant_kernel(features: CpuFeatures | None = None) -> tuple["QuantMatmul | None", str]:
    """The C kernel for products on GGUF blocks (or None) and a phrase for the log line."""
    from cadence.kernels.quant_matmul import quant_matmul

    features = cpu_features.detect() if features is None else features
    if not features.allows("native"):
        return None, "quantized matmuls in PyTorch, dequantized per call (C kernels hidden)"
    kernel = quant_matmul(features.compiler_arch())
    if kernel is None:
        return None, ("quantized matmuls in PyTorch, dequantized per call (C kernel unavailable: "
                      "no compiler, a failed build or CADENCE_NATIVE=0)")
    return kernel, f"quantized matmuls in C ({kernel.isa}, -march={features.compiler_arch()})"


def resolve_quantization(option: str, device: torch.device,
                         features: CpuFeatures | None = None) -> tuple[str, str | None]:
    """The loader's quantization mode for ``option`` on ``device``, and a note when
    ``auto`` falls back to dequantizing at load (None otherwise).

    ``auto`` keeps GGUF blocks on a CPU whose quantized kernel builds; ``gguf``
    keeps them on any CPU (PyTorch dequantizes per call without the kernel) and
    is refused on a GPU; ``none`` never keeps them.
    """
    if option == "none":
        return "none", None
    if device.type != "cpu":
        if option == "gguf":
            raise ValueError(f"quantization: gguf keeps weights quantized on the CPU only, not on "
                             f"{device.type}; use auto or none")
        return "none", None
    if option == "auto":
        kernel, reason = quant_kernel(features)
        if kernel is None:
            return "none", f"quantization auto: GGUF weights dequantized at load ({reason})"
    return option, None


def _native_kernels(dtype: torch.dtype, features: CpuFeatures):
    """(fused ops, attention kernel, None) or (None, None, why not)."""
    from cadence.kernels.fused_ops import fused_ops
    from cadence.kernels.paged_attention import paged_attention

    if not features.allows("native"):
        return None, None, "C kernels hidden"
    if dtype not in (torch.float32, torch.bfloat16):
        return None, None, f"no C kernels for {_name(dtype)}"
    march = features.compiler_arch()
    fused, attention = fused_ops(march), paged_attention(march)
    if fused is None or attention is None:
        return None, None, "C kernels unavailable: no compiler, a failed build or CADENCE_NATIVE=0"
    return fused, attention, None


def resolve_dtype(
    name: str,
    device: torch.device,
    *,
    checkpoint_dtype: torch.dtype | None = None,
    weights_kept: bool = False,
    features: CpuFeatures | None = None,
    cuda_bf16: bool | None = None,
) -> torch.dtype:
    """The torch dtype for option ``name`` (auto, float32, bfloat16, float16) on ``device``;
    ``weights_kept``: the loader keeps some matmul weights in GGUF blocks."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"dtype: must be auto or one of {tuple(DTYPES)}, got {name!r}")
        return DTYPES[name]
    dtype, _ = auto_dtype(device, checkpoint_dtype=checkpoint_dtype, weights_kept=weights_kept,
                          features=features, cuda_bf16=cuda_bf16)
    return dtype


def auto_dtype(
    device: torch.device,
    *,
    checkpoint_dtype: torch.dtype | None = None,
    weights_kept: bool = False,
    features: CpuFeatures | None = None,
    cuda_bf16: bool | None = None,
) -> tuple[torch.dtype, str]:
    """``dtype="auto"`` on ``device``, and why (a phrase for the start-up log)."""
    if device.type == "cuda":
        if cuda_bf16 is None:
            cuda_bf16 = torch.cuda.is_bf16_supported()
        return _auto_cuda_dtype(checkpoint_dtype, cuda_bf16)
    features = cpu_features.detect() if features is None else features
    if weights_kept:
        return torch.float32, ("GGUF weights kept in blocks run fastest with float32 activations, "
                               "even where bfloat16 is native (BENCHMARKS.md)")
    where = (f"on an {features.resolve_as} CPU ({cpu_features.RESOLVE_AS_ENV})" if features.resolve_as
             else "on this CPU")
    if features.defaults_bf16:
        return torch.bfloat16, f"float weights, and bfloat16 is native {where}"
    return torch.float32, f"float weights, and bfloat16 is not native {where}"


def _auto_cuda_dtype(checkpoint_dtype: torch.dtype | None, cuda_bf16: bool) -> tuple[torch.dtype, str]:
    if checkpoint_dtype == torch.float16 or (checkpoint_dtype == torch.bfloat16 and cuda_bf16):
        return checkpoint_dtype, f"the checkpoint's own {_name(checkpoint_dtype)}"
    if cuda_bf16:
        return torch.bfloat16, "a float32 (or unknown) checkpoint, in half precision, bfloat16 on this GPU"
    return torch.float16, "half precision, and this GPU has no bfloat16"


def emulation_note(dtype: torch.dtype, features: CpuFeatures) -> str | None:
    """Why ``dtype`` will be slow on this CPU (computed in software), or None."""
    if dtype == torch.bfloat16 and not features.native_bf16:
        return "bfloat16 is emulated on this CPU (no AVX512_BF16, AMX or ARM BF16): expect it slower than float32"
    if dtype == torch.float16 and not any(flag in features.flags for flag in _FP16_FLAGS):
        return "float16 is emulated on this CPU (no AVX512_FP16, AMX-FP16 or ARM FP16): expect it slower than float32"
    return None


def log_cpu_choice(dtype: torch.dtype, paths: CpuPaths, features: CpuFeatures | None = None,
                   *, log: TextIO = sys.stderr) -> None:
    """The one start-up line naming this CPU, the dtype and the paths taken (and a
    second when the dtype is emulated)."""
    features = cpu_features.detect() if features is None else features
    print(f"cadence: CPU {features.describe()}, {_name(dtype)}: {paths.describe()}", file=log)
    note = emulation_note(dtype, features)
    if note is not None:
        print(f"cadence: {note}", file=log)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
