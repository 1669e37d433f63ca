"""Matmuls on GGUF's quantized blocks in C, for the CPU (``cadence/kernels/csrc/quant_matmul.c``).

``x [M, K] @ W^T`` with W kept as ggml blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K,
Q6_K, IQ4_NL, IQ4_XS) and x
rounded per group of 32 values to int16 steps of max|x| / 32767 (llama.cpp
rounds its activations to int8; these steps are 256 times finer;
``round_activations`` shows the values), or, for the types of
``quantized.BYTE_ACTIVATION_TYPES`` (Q4_K, Q6_K), per 256 values to int8 steps of
max|x| / 127 (llama.cpp's Q8_K), which the x86 builds multiply as bytes, in
the decode path and in byte tiles for many rows (AVX-512: VNNI's vpdpbusd). A decode step's few rows (up to 4,
or up to ``direct_max_rows``: 12 while M * K <= 10240 with AVX-512, 16 of any
length with AVX2 alone) multiply the weight's integers with x's in registers, four rows at a time
(about half the instructions of decoding the weights to float32); more rows get a few weight rows at a time decoded to float32 and multiplied
with the rounded rows, so the weight's bytes are read once per call and
their decoding is shared by all rows (prefill, batches). Both compute the
same product up to the order of float32 sums, so a request's tokens do not
depend on its batch. Built with AVX2 FMA where the build's ``-march`` has
them, as plain C otherwise; with AVX-512 (F, BW) both paths multiply
integers, 32 products per instruction in 16 bits and 64 in bytes (VNNI where
the CPU has it), the tiles decoded to integers instead of float32 (``isa``
says which). ``quant_matmul()`` is None where
the library cannot be built; callers then dequantize in PyTorch.

``QuantMatmul.rows_apart()`` is the same kernel taking the integer path at every
number of rows (the batch-invariant mode): a row's value is then the one it has
alone, whatever rows are beside it, at the cost of the tiles' speed for many
rows (BENCHMARKS.md, batch-invariance-v1). Where the build has no integer path
(plain C) every product already computes each row alone.

Types are passed as ggml's numeric ids (``GGMLQuantizationType`` values),
so this module needs nothing of the ``gguf`` package.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from cadence.kernels import build

# ggml type id -> (name, values per block, bytes per block)
KERNEL_TYPES = {
    8: ("Q8_0", 32, 34), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 20: ("IQ4_NL", 32, 18), 23: ("IQ4_XS", 256, 136),
}
_PTR, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
SIGNATURES = {
    # type, weight, n, k, x, m, x_stride, out, out_stride
    "quant_matmul": [_INT, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64],
    # the same arguments
    "quant_matmul_rows_apart": [_INT, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64],
    # type, x, m, k, out
    "quant_round_activations": [_INT, _PTR, _I64, _I64, _PTR],
    # type, weight, k, ids, count, out
    "quant_dequantize_rows": [_INT, _PTR, _I64, _PTR, _I64, _PTR],
    # iterations -> multiply-adds done
    "quant_int16_peak_macs": [_I64],
    # -> rows up to which products take the integer path
    "quant_direct_max_rows": [],
}


class QuantMatmul:
    """The library's functions with tensor arguments (float32 activations)."""

    def __init__(self, library: ctypes.CDLL, *, rows_apart: bool = False) -> None:
        self._library = library
        self._functions = build.bind(library, SIGNATURES)
        # True: every row's value independent of the rows beside it (``rows_apart``).
        self.computes_rows_apart = rows_apart
        self._matmul = self._functions["quant_matmul_rows_apart" if rows_apart else "quant_matmul"]
        self._functions["quant_int16_peak_macs"].restype = _I64
        describe = library.quant_matmul_isa
        describe.restype, describe.argtypes = ctypes.c_char_p, []
        self.isa: str = describe().decode()
        # Rows up to which products stay in integers; more are tiled (row-invariant).
        self.direct_max_rows: int = self._functions["quant_direct_max_rows"]()

    def rows_apart(self) -> "QuantMatmul":
        """This kernel with every product's rows computed as each would be alone: the
        integer path at every number of rows (the batch-invariant mode's products)."""
        return QuantMatmul(self._library, rows_apart=True)

    def matmul(self, x: torch.Tensor, blocks: torch.Tensor, type_id: int, k: int) -> torch.Tensor:
        """float32 ``x [M, k] @ W^T`` -> [M, N], W being ``blocks`` uint8 [N, row bytes] of ``type_id``."""
        check_blocks(blocks, type_id, k)
        return self.matmul_checked_blocks(x, blocks, type_id, k)

    def matmul_checked_blocks(self, x: torch.Tensor, blocks: torch.Tensor, type_id: int, k: int,
                              out: torch.Tensor | None = None) -> torch.Tensor:
        """``matmul`` for blocks the caller has passed through ``check_blocks`` once (a model's
        weights, at load): a decode step makes hundreds of these calls, each a few microseconds.
        ``out``: a contiguous float32 [M, N] to write the product into (and return)."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"quant_matmul: x must be float32 [M, {k}], got {x.dtype} {tuple(x.shape)}")
        x = x.contiguous()
        n = blocks.shape[0]
        if out is None:
            out = torch.empty(x.shape[0], n, dtype=torch.float32)
        elif out.dtype != torch.float32 or out.shape != (x.shape[0], n) or not out.is_contiguous():
            raise ValueError(f"quant_matmul: out must be contiguous float32 [{x.shape[0]}, {n}], "
                             f"got {out.dtype} {tuple(out.shape)}")
        status = self._matmul(type_id, blocks.data_ptr(), n, k, x.data_ptr(), x.shape[0], k, out.data_ptr(), n)
        if status:
            _check_status(status)
        return out

    def round_activations(self, x: torch.Tensor, type_id: int = 8) -> torch.Tensor:
        """x [M, K] float32 as the products on ``type_id``'s weights see it: each group of
        32 values rounded to int16 steps of max|x| / 32767, or int8 steps of max|x| / 127
        for the byte types (``quantized.round_activations`` in PyTorch computes the same)."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] % 32:
            raise ValueError(f"quant_round_activations: x must be float32 [M, 32n], got {x.dtype} {tuple(x.shape)}")
        x = x.contiguous()
        out = torch.empty_like(x)
        _check_status(self._functions["quant_round_activations"](type_id, x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr()))
        return out

    def int16_peak_macs(self, iterations: int) -> int:
        """Run the integer products' instruction ``iterations`` x 12 times from registers
        (one core; for the benchmarks' peak): the multiply-adds done, 0 without AVX2."""
        return int(self._functions["quant_int16_peak_macs"](iterations))

    def dequantize_rows(self, blocks: torch.Tensor, type_id: int, k: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (int64, any shape) of W as float32 [*ids.shape, k] (an embedding lookup)."""
        check_blocks(blocks, type_id, k)
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= blocks.shape[0]):
            raise IndexError(f"quant_dequantize_rows: ids out of range [0, {blocks.shape[0]})")
        out = torch.empty(flat.numel(), k, dtype=torch.float32)
        status = self._functions["quant_dequantize_rows"](
            type_id, blocks.data_ptr(), k, flat.data_ptr(), flat.numel(), out.data_ptr())
        _check_status(status)
        return out.reshape(*ids.shape, k)


def row_bytes(type_id: int, k: int) -> int:
    """Bytes one row of ``k`` values takes in blocks of ``type_id``."""
    _, values, size = KERNEL_TYPES[type_id]
    return k // values * size


def check_blocks(blocks: torch.Tensor, type_id: int, k: int) -> None:
    """ValueError unless ``blocks`` holds rows of ``k`` values of ``type_id`` as the kernel reads them."""
    if type_id not in KERNEL_TYPES:
        raise ValueError(f"quant_matmul: no kernel for ggml type {type_id}")
    name, values, _ = KERNEL_TYPES[type_id]
    if k % values or blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous() \
            or blocks.shape[1] != row_bytes(type_id, k):
        raise ValueError(f"quant_matmul: {name} rows of {k} values must be contiguous uint8 "
                         f"[N, {row_bytes(type_id, k) if k % values == 0 else '?'}], got "
                         f"{blocks.dtype} {tuple(blocks.shape)}")


def _check_status(status: int) -> None:
    if status == -2:
        raise MemoryError("quant_matmul: no memory for a tile buffer")
    if status != 0:
        raise ValueError(f"quant_matmul: the kernel refused its arguments (status {status})")


@functools.cache
def quant_matmul(march: str = "native") -> QuantMatmul | None:
    """The compiled functions, or None (no compiler, build failed, or CADENCE_NATIVE=0)."""
    library = build.load("quant_matmul", march)
    return None if library is None else QuantMatmul(library)
