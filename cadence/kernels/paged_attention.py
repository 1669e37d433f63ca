"""The paged-attention C kernel (``cadence/kernels/csrc/paged_attention.c``) with tensor arguments.

Built and loaded by ``cadence.kernels.build``; ``paged_attention()`` is None where
it cannot be (no compiler, ``CADENCE_NATIVE=0``) and the runner keeps its
PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from cadence.kernels import build
# (query and output dtype, cache dtype) -> the C function's suffix.
SUFFIXES = {
    (torch.float32, torch.float32): "f32",
    (torch.bfloat16, torch.bfloat16): "bf16",
    (torch.float32, torch.float16): "f32_kvf16",
    (torch.float32, torch.bfloat16): "f32_kvbf16",
    (torch.float32, torch.uint8): "f32_kvq8_0",  # q8_0 blocks (cadence.runner.kv_quant)
}
_I64 = ctypes.c_int64
_INT = ctypes.c_int
# paged_attention_<suffix>: q, k_cache, v_cache, out, query_start, query_len,
# seq_len, block_table; num_seqs; heads, kv heads, head dim, block size,
# max blocks, window; scale, soft-cap (0: none) (checked against the C prototype by the tests).
ARGTYPES = [ctypes.c_void_p] * 8 + [_I64] + [_INT] * 6 + [ctypes.c_float] * 2


class PagedAttentionKernel:
    """``paged_attention_<suffix>`` of the compiled library, with tensor arguments."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions = {}
        for dtypes, suffix in SUFFIXES.items():
            function = getattr(library, f"paged_attention_{suffix}")
            function.restype = None
            function.argtypes = ARGTYPES
            self._functions[dtypes] = function

    def supports(self, dtype: torch.dtype, kv_cache_dtype: torch.dtype | None = None) -> bool:
        """Whether queries of ``dtype`` can attend over a cache of ``kv_cache_dtype``
        (default: the same)."""
        return (dtype, kv_cache_dtype or dtype) in self._functions

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
        softcap: float | None = None,
    ) -> None:
        """Attention of the S sequences' query rows over their cached keys, into ``out``
        (scores soft-capped at ``softcap``, Gemma 2's, where given)."""
        for t, dtype in ((q, q.dtype), (out, q.dtype), (key_blocks, key_blocks.dtype),
                         (value_blocks, key_blocks.dtype)):
            if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError("paged attention: q and out (of one dtype) and the caches (of "
                                 f"one dtype) must be contiguous CPU tensors, got {t.dtype} {tuple(t.shape)}")
        function = self._functions.get((q.dtype, key_blocks.dtype))
        if function is None:
            raise ValueError(f"paged attention: no kernel for {q.dtype} queries over a "
                             f"{key_blocks.dtype} cache")
        for t, dtype in ((query_start, torch.int64), (query_len, torch.int64),
                         (seq_len, torch.int64), (block_table, torch.int32)):
            if t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"paged attention: index tensors must be contiguous {dtype}")
        num_heads, head_dim = q.shape[1], q.shape[2]
        _, block_size, num_kv_heads, _ = key_blocks.shape
        function(
            q.data_ptr(), key_blocks.data_ptr(), value_blocks.data_ptr(), out.data_ptr(),
            query_start.data_ptr(), query_len.data_ptr(), seq_len.data_ptr(),
            block_table.data_ptr(), len(seq_len), num_heads, num_kv_heads, head_dim,
            block_size, block_table.shape[1], sliding_window or 0, scale, softcap or 0.0,
        )


@functools.cache
def paged_attention(march: str = "native") -> PagedAttentionKernel | None:
    """The compiled kernel, or None (no compiler, build failed, or CADENCE_NATIVE=0)."""
    library = build.load("paged_attention", march)
    return None if library is None else PagedAttentionKernel(library)
