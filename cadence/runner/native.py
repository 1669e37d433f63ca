"""CPU kernels written in C, compiled on first use and called through ctypes.

One kernel so far: attention of short queries straight over the paged KV
cache (``csrc/paged_attention.c``). It is built with the machine's C compiler
(``-O3 -march=native -fopenmp``) into a cache folder, keyed by the source,
the flags and the CPU, so a second process loads it in milliseconds:

    $CADENCE_CACHE_DIR (default ~/.cache/cadence)/kernels/paged_attention-<key>.so

Without a compiler, or with ``CADENCE_NATIVE=0``, ``paged_attention()``
returns None and the runner keeps its PyTorch path; nothing else changes.

The library links OpenMP's ``libgomp.so.1``. Loaded after torch, the
dynamic loader hands it torch's own copy (same soname), so the kernel runs on
torch's threads and honours ``torch.set_num_threads``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("paged_attention.c", "paged_attention_impl.h")
# -fassociative-math (with the two it needs) lets the compiler vectorise dot
# products; no -ffast-math: it would also assume no inf or NaN.
CFLAGS = (
    "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared",
    "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
)
_ELEMENT_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_I64 = ctypes.c_int64
_INT = ctypes.c_int


class PagedAttentionKernel:
    """``paged_attention_{f32,bf16}`` of the compiled library, with tensor arguments."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions = {}
        for dtype, suffix in _ELEMENT_SUFFIX.items():
            function = getattr(library, f"paged_attention_{suffix}")
            function.restype = None
            function.argtypes = [ctypes.c_void_p] * 8 + [_I64] + [_INT] * 6 + [ctypes.c_float]
            self._functions[dtype] = function

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._functions

    def __call__(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        key_blocks: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        value_blocks: torch.Tensor,
        out: torch.Tensor,  # [T, Hq, D], rows of the given sequences are written
        query_start: torch.Tensor,  # [S] int64
        query_len: torch.Tensor,  # [S] int64
        seq_len: torch.Tensor,  # [S] int64
        block_table: torch.Tensor,  # [S, max_blocks] int32
        sliding_window: int | None,
        scale: float,
    ) -> None:
        """Attention of the S sequences' query rows over their cached keys, into ``out``."""
        for t in (q, key_blocks, value_blocks, out):
            if t.dtype != q.dtype or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError("paged attention: q, caches and out must be contiguous CPU "
                                 f"tensors of one dtype, got {t.dtype} {tuple(t.shape)}")
        for t, dtype in ((query_start, torch.int64), (query_len, torch.int64),
                         (seq_len, torch.int64), (block_table, torch.int32)):
            if t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"paged attention: index tensors must be contiguous {dtype}")
        num_heads, head_dim = q.shape[1], q.shape[2]
        _, block_size, num_kv_heads, _ = key_blocks.shape
        self._functions[q.dtype](
            q.data_ptr(), key_blocks.data_ptr(), value_blocks.data_ptr(), out.data_ptr(),
            query_start.data_ptr(), query_len.data_ptr(), seq_len.data_ptr(),
            block_table.data_ptr(), len(seq_len), num_heads, num_kv_heads, head_dim,
            block_size, block_table.shape[1], sliding_window or 0, scale,
        )


@functools.cache
def paged_attention() -> PagedAttentionKernel | None:
    """The compiled kernel, or None (no compiler, build failed, or CADENCE_NATIVE=0)."""
    if os.environ.get("CADENCE_NATIVE", "1") == "0":
        return None
    try:
        return PagedAttentionKernel(ctypes.CDLL(str(_build("paged_attention"))))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", None) or ""
        warnings.warn(f"cadence: native paged attention unavailable ({error}) {detail[-500:]}; "
                      "using the PyTorch path", RuntimeWarning, stacklevel=2)
        return None


def _build(name: str) -> Path:
    """Compile ``csrc/<name>.c`` unless the cache already holds this exact build."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc or gcc) on PATH")
    target = _cache_dir() / f"{name}-{_build_key(compiler)}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        subprocess.run(
            [compiler, *CFLAGS, "-o", str(built), str(CSRC / f"{name}.c"), "-lm"],
            check=True, capture_output=True, text=True,
        )
        os.replace(built, target)
    return target


def _build_key(compiler: str) -> str:
    """Hash of everything the binary depends on: sources, compiler, flags, CPU."""
    digest = hashlib.sha256()
    for source in SOURCES:
        digest.update((CSRC / source).read_bytes())
    digest.update(" ".join((compiler, *CFLAGS)).encode())
    digest.update(_cpu_signature().encode())
    return digest.hexdigest()[:16]


def _cpu_signature() -> str:
    """The CPU's model and feature flags (``-march=native`` depends on them)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(lines))


def _cache_dir() -> Path:
    root = os.environ.get("CADENCE_CACHE_DIR") or Path.home() / ".cache" / "cadence"
    return Path(root) / "kernels"
