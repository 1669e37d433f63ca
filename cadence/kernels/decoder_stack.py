"""Every decoder layer of a short-query step in one C call (``cadence/kernels/csrc/decoder_stack.c``).

The structures mirror the C ones field for field (``decoder_struct_layout``
lets the tests compare them); ``cadence.runner.fused_decoder`` fills them
from a model and its KV cache. ``decoder_stack()`` is None where the library
cannot be built (see ``cadence.kernels.build``).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from cadence.kernels import build

_PTR, _I64, _FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
MAX_PARTS = 3
# The cache's element type, the layers' norm placement, the MLP's activation,
# the q/k norm and a layer's rotary tables, as the C side numbers them.
CACHE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.uint8: 3}  # uint8: q8_0 blocks
NORM_PLACEMENTS = {"pre": 0, "post": 1, "sandwich": 2}
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
QK_NORMS = {None: 0, "per_head": 1, "whole": 2}
ROTARY_NONE, ROTARY_MAIN, ROTARY_SLIDING = 0, 1, 2
TYPE_F32_ROWS = 0  # a BlockMatrix of float32 rows (ggml's F32): a router kept in float


class BlockMatrix(ctypes.Structure):
    """Rows of a matrix in ggml blocks (one part of a projection)."""

    _fields_ = [("type", _I64), ("blocks", _PTR), ("rows", _I64)]


class ExpertMatrices(ctypes.Structure):
    """One routed expert's SwiGLU matrices: gate|up in parts, down."""

    _fields_ = [("gate_up", BlockMatrix * MAX_PARTS), ("gate_up_parts", _I64), ("down", BlockMatrix)]


class DecoderLayer(ctypes.Structure):
    """One layer's weights (float32 norms, block matrices) and its key/value caches.
    ``experts`` ([E] ExpertMatrices, with ``router``) makes its MLP routed experts; NULL: the dense one."""

    _fields_ = [
        ("input_norm", _PTR), ("post_attention_norm", _PTR),
        ("pre_feedforward_norm", _PTR), ("post_feedforward_norm", _PTR),
        ("q_norm", _PTR), ("k_norm", _PTR),
        ("qkv", BlockMatrix * MAX_PARTS), ("qkv_parts", _I64), ("qkv_bias", _PTR),
        ("o", BlockMatrix),
        ("gate_up", BlockMatrix * MAX_PARTS), ("gate_up_parts", _I64),
        ("down", BlockMatrix),
        ("router", BlockMatrix), ("experts", _PTR),
        ("key_cache", _PTR), ("value_cache", _PTR),
        ("rotary", _I64), ("full_attention", _I64), ("group", _I64),
    ]


class DecoderShape(ctypes.Structure):
    """The model's sizes and building blocks, the cache's element type, the norms' eps, attention's
    scale and soft-cap (0: none), and the routed experts' sizes (0 experts: none)."""

    _fields_ = [
        ("num_layers", _I64), ("hidden", _I64), ("num_heads", _I64), ("num_kv_heads", _I64),
        ("head_dim", _I64), ("intermediate", _I64), ("cache_dtype", _I64), ("block_size", _I64),
        ("num_slots", _I64), ("norm_placement", _I64), ("activation", _I64), ("qk_norm", _I64),
        ("rotary_dim", _I64), ("eps", _FLOAT), ("scale", _FLOAT), ("softcap", _FLOAT),
        ("num_experts", _I64), ("experts_per_token", _I64), ("expert_intermediate", _I64),
        ("norm_topk_prob", _I64), ("rows_apart", _I64),
    ]


class DecoderStep(ctypes.Structure):
    """One step's tokens (rotary rows, cache slots) and sequences (as the attention kernel reads them)."""

    _fields_ = [
        ("num_tokens", _I64), ("cos", _PTR), ("sin", _PTR), ("sliding_cos", _PTR), ("sliding_sin", _PTR),
        ("slot_mapping", _PTR),
        ("query_start", _PTR), ("query_len", _PTR), ("seq_len", _PTR), ("block_table", _PTR),
        ("num_seqs", _I64), ("max_blocks", _I64), ("sliding_window", _I64),
        ("group_block_tables", _PTR), ("group_slot_mappings", _PTR),
    ]


# Name -> argtypes (checked against the C prototypes by the tests).
SIGNATURES = {
    # shape, layers, final norm, step, hidden (in: embeddings; overwritten), out
    "decoder_stack": [_PTR] * 6,
    # src, n, cache dtype, dst
    "decoder_store_row": [_PTR, _I64, _I64, _PTR],
    # out: sizeof and offsets of the structures
    "decoder_struct_layout": [_PTR],
}
STRUCTURES = (DecoderLayer, DecoderShape, DecoderStep, BlockMatrix, ExpertMatrices)


class DecoderStackKernel:
    """The library's functions."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions = build.bind(library, SIGNATURES)
        self._run = self._functions["decoder_stack"]

    def run(self, shape: DecoderShape, layers: ctypes.Array, final_norm: torch.Tensor, step: DecoderStep,
            hidden: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` [T, H] = the stack's final-normed output for embeddings ``hidden`` [T, H]
        (float32, contiguous; ``hidden`` is overwritten). The caller has checked every pointer."""
        status = self._run(ctypes.byref(shape), layers, final_norm.data_ptr(), ctypes.byref(step),
                           hidden.data_ptr(), out.data_ptr())
        if status == -2:
            raise MemoryError("decoder_stack: no memory for the step's buffers")
        if status:
            raise ValueError(f"decoder_stack: the kernels refused their arguments (status {status})")

    def store_row(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """float32 x [n] as the C side stores it in a cache of ``dtype`` (uint8: q8_0 bytes)."""
        x = x.to(torch.float32).contiguous()
        out = torch.empty(x.numel() // 32 * 34 if dtype == torch.uint8 else x.numel(), dtype=dtype)
        if self._functions["decoder_store_row"](x.data_ptr(), x.numel(), CACHE_DTYPES[dtype], out.data_ptr()):
            raise ValueError(f"decoder_store_row: no cache of {dtype}")
        return out

    def struct_layout(self) -> list[int]:
        """sizeof and field offsets of DecoderLayer, DecoderShape, DecoderStep, BlockMatrix and
        ExpertMatrices, as C lays them out."""
        out = (ctypes.c_int64 * 67)()
        self._functions["decoder_struct_layout"](out)
        return list(out)


def ctypes_layout() -> list[int]:
    """What ``DecoderStackKernel.struct_layout`` must return for these structures."""
    layout = []
    for structure in STRUCTURES:
        layout.append(ctypes.sizeof(structure))
        layout.extend(getattr(structure, name).offset for name, _ in structure._fields_)
    return layout


@functools.cache
def decoder_stack(march: str = "native") -> DecoderStackKernel | None:
    """The compiled library, or None (no compiler, build failed, or CADENCE_NATIVE=0)."""
    library = build.load("decoder_stack", march)
    return None if library is None else DecoderStackKernel(library)
