"""Batch invariance (``batch_invariant``): a request's greedy tokens are the same
alone and in any batch, with or without LoRA.

A row's result may depend on the rows computed beside it: a library picks
another kernel, or another order of its float sums, by the number of rows,
and attention over a padded batch or a longer chunk sums its keys in other
blocks. Measured on this project's CPUs (torch 2.13 with MKL and oneDNN;
AVX-512 with BF16, and AVX2 via MKL_ENABLE_INSTRUCTIONS / ONEDNN_MAX_CPU_ISA;
1, 2 and 8 threads; every row compared with its value in 64-row products),
each op and what the mode does about it:

    op                               depends on the batch where            under the mode
    products, float32 on MKL         fewer than 12 rows (rows of an        every step runs at least
      (F.linear, unpacked)           unfinished group of 4)                ``min_rows`` rows (16 here)
    products on oneDNN (packed       one row (gemv)                        2 rows
      float32, bfloat16 on a CPU
      that computes it natively)
    products on GGUF blocks (C)      up to 12 rows stay in integers (16    the integer path at every
                                     with AVX2 alone), more are tiled:     number of rows
                                     other float sums                      (``QuantMatmul.rows_apart``):
                                                                           no padding
    bfloat16 computed in software    at every number of rows               refused
    attention on SDPA                padded batches and key blocks follow  every sequence on the C
                                     the batch's lengths                   kernel, which computes a
                                                                           query row alone, keys in
                                                                           order (long queries in
                                                                           pieces of 32 tokens)
    LoRA deltas                      products over each adapter's rows     those rows padded too
    LM head (and prompt logprobs)    a product over the sampled rows       padded like a step
    norms, rotary, SiLU, embedding,  never: row by row                     -
      greedy sampling
    mixture-of-experts               each expert's rows                    refused
    a GPU (Triton, cuBLAS)           split-K and tiles by shape            refused

A step shorter than ``min_rows`` gets padding rows: copies of its last token,
each a one-token sequence of its own (``pad_step``), which nothing samples.

``auto`` is on where the mode costs under 5% of single-stream and of
batch-64 throughput (BENCHMARKS.md, batch-invariance-v1, taken with
``bench/batch_invariance.py``; 2 threads):

    weights                         batch 64   single stream   auto
    dense float (float32, bfloat16) -1 to -2%   3 to 4%        on: decodes already take the C
                                                               attention kernel; one row padded
                                                               to two on oneDNN
    GGUF blocks on the C kernel     15-26%     0-4%            off: every product in integers,
                                                               where batches and prompts would
                                                               take the float32 tiles (AVX2-only
                                                               EPYC, default model and Gemma 3)

(Padding every step past the integer path onto the tiles instead, as the
mode did first, costs batch 64 nothing and single stream 88-89%.)

Not counted: a 2,000-token prefill costs 36-43% (products in integers,
and attention on the C kernel instead of SDPA).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from cadence import cpu_features
from cadence.cpu_features import CpuFeatures
from cadence.kernels import packed_weights
from cadence.models.layers import Linear
from cadence.models.quantized import QuantizedTensor
from cadence.models.row_padding import pad_rows_product

if TYPE_CHECKING:
    from cadence.kernels.quant_matmul import QuantMatmul
    from cadence.models.llama import LlamaForCausalLM

# Rows from which each kind of product gives every row the value it has in
# any larger product (see the module doc).
ONEDNN_ROWS = 2
MKL_FLOAT32_ROWS = 16
# The libraries that compute a model's products.
QUANT_KERNEL, ONEDNN, PYTORCH = "quantized C kernel", "oneDNN packed", "PyTorch"


@dataclass(frozen=True)
class BatchInvariance:
    """Whether the runner computes every row independently of its batch, and why.

    ``min_rows``: the fewest rows any product of the model runs on (steps and
    sampled rows are padded up to it); ``lora_min_rows``: the same for the
    LoRA deltas' products (1 without LoRA). Both 1 when off.
    """

    enabled: bool
    reason: str
    min_rows: int = 1
    lora_min_rows: int = 1
    # Products on GGUF blocks through ``QuantMatmul.rows_apart()`` (the integer path at any rows).
    quant_rows_apart: bool = False

    @classmethod
    def off(cls, reason: str) -> "BatchInvariance":
        return cls(False, reason)

    def describe(self) -> str:
        """The start-up log's phrase."""
        if not self.enabled:
            return f"batch-invariant mode off ({self.reason})"
        parts = []
        if self.quant_rows_apart:
            parts.append("products on GGUF blocks in integers at every number of rows")
        if self.min_rows > 1:
            parts.append(f"products on at least {self.min_rows} rows (short steps padded)")
        if self.lora_min_rows > 1:
            parts.append(f"each adapter's rows padded to {self.lora_min_rows}")
        parts.append("attention one query row at a time on the C kernel")
        return f"batch-invariant mode on ({self.reason}): " + ", ".join(parts)


def resolve_batch_invariance(
    option: str,
    model: torch.nn.Module,
    *,
    device: torch.device,
    dtype: torch.dtype,
    attention_kernel: bool,
    lora: bool = False,
    num_experts: int = 0,
    features: CpuFeatures | None = None,
) -> BatchInvariance:
    """The mode ``option`` (auto, on, off) asks for, made concrete for this model and machine.

    ``attention_kernel``: the runner attends with the C kernel; ``lora``: it
    serves LoRA adapters (dense products of their own). ``on`` where no
    invariant path exists raises ValueError naming the option.
    """
    if option == "off":
        return BatchInvariance.off("by request")
    min_rows, on_quant_kernel, dense = product_min_rows(model, dtype)
    dense = dense or lora
    blocker = _blocker(device, dtype, attention_kernel, num_experts, dense, features)
    if blocker is None and dense:
        if not _dense_products_are_row_invariant(dtype):
            blocker = (f"this CPU's {_name(dtype)} products give a row another value with the "
                       f"number of rows beside it, even past the measured floors (probed)")
    if blocker is not None:
        if option == "on":
            raise ValueError(f"batch_invariant: on has no batch-invariant path here: {blocker}; "
                             f"use auto or off")
        return BatchInvariance.off(blocker)
    lora_rows = pytorch_min_rows(dtype) if lora else 1
    if option == "on":
        return BatchInvariance(True, "by request", min_rows, lora_rows, quant_rows_apart=on_quant_kernel)
    if on_quant_kernel:
        return BatchInvariance.off(
            "auto: weights kept in GGUF blocks, whose products of many rows would leave their tiles "
            "for the integer path, which costs batch 64 over 5% (BENCHMARKS.md, batch-invariance-v1)")
    return BatchInvariance(True, "auto: dense float weights, under 5% of single-stream and "
                                 "batch-64 throughput (BENCHMARKS.md, batch-invariance-v1)",
                           min_rows, lora_rows)


def _blocker(device: torch.device, dtype: torch.dtype, attention_kernel: bool, num_experts: int,
             dense: bool, features: CpuFeatures | None) -> str | None:
    """Why no batch-invariant path exists for this configuration, or None. ``dense``:
    some product runs in PyTorch (not on GGUF blocks in C)."""
    if device.type != "cpu":
        return f"on {device.type} the attention kernels and products pick tiles by the batch's shape"
    if num_experts:
        return "a mixture-of-experts model: each expert's product runs on the rows routed to it"
    if not attention_kernel:
        return ("attention would run on PyTorch's SDPA (no C kernel for this dtype and KV cache, "
                "or C kernels unavailable)")
    features = cpu_features.detect() if features is None else features
    if dense and dtype == torch.bfloat16 and not features.native_bf16:
        return ("bfloat16 is computed in software on this CPU, and its dense products depend on the "
                "number of rows at every size")
    return None


def pytorch_min_rows(dtype: torch.dtype) -> int:
    """Rows a product in PyTorch (F.linear, matmul) of ``dtype`` needs to be row-invariant:
    bfloat16 goes to oneDNN, float32 to MKL (see the module doc)."""
    return ONEDNN_ROWS if dtype == torch.bfloat16 else MKL_FLOAT32_ROWS


def product_min_rows(model: "LlamaForCausalLM", dtype: torch.dtype) -> tuple[int, bool, bool]:
    """The rows every product of ``model`` needs, whether some run on the quantized C
    kernel, and whether some run in PyTorch (dense, or blocks dequantized per call).
    The C kernel's products under the mode (``QuantMatmul.rows_apart``) need one."""
    kinds = _product_kinds(model)
    floors = {ONEDNN: ONEDNN_ROWS, PYTORCH: pytorch_min_rows(dtype), QUANT_KERNEL: 1}
    rows = max(floors[kind] for kind in kinds)
    return rows, QUANT_KERNEL in kinds, bool(kinds - {QUANT_KERNEL})


def _product_kinds(model: "LlamaForCausalLM") -> set[str]:
    """Which libraries compute the model's products (the LM head's included)."""
    kinds: set[str] = set()
    for module in model.modules():
        if isinstance(module, Linear):
            if module.packed_weight is not None:
                kinds.add(ONEDNN)
            elif module.quantized is None:
                kinds.add(PYTORCH)
            else:
                kinds |= _parts_kinds(module.quantized, module.quant_kernel is not None)
    table = model.model.embed_tokens.quantized
    if model.lm_head is None and model.tied_head_packed is None:  # (an untied head is a Linear)
        kinds |= {PYTORCH} if table is None else _parts_kinds((table,), model.quant_kernel is not None)
    return kinds


def _parts_kinds(parts, kernel: bool) -> set[str]:
    """Float parts, and blocks without the C kernel, go through F.linear."""
    return {QUANT_KERNEL if isinstance(part, QuantizedTensor) and kernel else PYTORCH for part in parts}


@functools.cache
def _dense_products_are_row_invariant(dtype: torch.dtype) -> bool:
    """Whether rows of dense ``dtype`` products, padded to their floors, keep their values
    at every number of rows: a trial on small random matrices, unpacked and packed,
    once per process (it checks the measured rule on this machine; it proves nothing)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 544, generator=generator).to(dtype)
    x = torch.randn(80, 544, generator=generator).to(dtype)
    products = [(lambda rows: F.linear(rows, weight), pytorch_min_rows(dtype))]
    if packed_weights.packing_works(dtype):
        packed = packed_weights.pack(weight)
        products.append((lambda rows: packed_weights.packed_linear(rows, packed, None), ONEDNN_ROWS))
    for product, min_rows in products:
        whole = product(x)  # [80, 96]
        for start, count in ((0, 1), (5, 2), (9, 3), (17, 7), (3, 13), (30, 17), (40, 33)):
            part = pad_rows_product(product, x[start:start + count], min_rows)
            if not torch.equal(part, whole[start:start + count]):
                return False
    return True


@dataclass(frozen=True)
class ForwardInputs:
    """What one forward reads: the step's token rows, then any padding rows.

    Sequence s owns rows ``query_start_loc[s] : query_start_loc[s + 1]``; padding
    sequences come last, one row each (``pad_step``), their adapters those of
    the step's last sequence.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: list[int]  # [S + 1]
    seq_lens: list[int]  # [S]
    block_table: torch.Tensor  # [S, max_blocks] int32
    num_padding: int = 0
    # KV cache groups: each group's slots and block tables (None: one group).
    group_slot_mappings: torch.Tensor | None = None  # [G, T] int64
    group_block_tables: torch.Tensor | None = None  # [G, S, max_blocks] int32


def forward_inputs(step) -> ForwardInputs:
    """The step's own rows (``StepInputs``), unpadded."""
    return ForwardInputs(step.input_ids, step.positions, step.slot_mapping,
                         step.query_start_loc.tolist(), step.seq_lens.tolist(), step.block_table,
                         group_slot_mappings=step.group_slot_mappings,
                         group_block_tables=step.group_block_tables)


def pad_step(inputs: ForwardInputs, min_rows: int) -> ForwardInputs:
    """``inputs`` with padding rows appended up to ``min_rows`` rows.

    Each padding row repeats the step's last token as a sequence of its own
    (one query at that position, the same blocks). Products never mix rows,
    so it computes exactly the key and value the real row computes, writes
    them to the same slot, and changes nothing; its output is dropped. (No
    scratch block is needed, and no memory beyond the cache's budget.)
    """
    num_padding = min_rows - len(inputs.input_ids)
    if num_padding <= 0:
        return inputs
    repeat = lambda t: torch.cat([t, t[-1:].expand(num_padding, *t.shape[1:])])  # noqa: E731
    last_position = int(inputs.positions[-1])
    last = inputs.query_start_loc[-1]
    return ForwardInputs(
        input_ids=repeat(inputs.input_ids),
        positions=repeat(inputs.positions),
        slot_mapping=repeat(inputs.slot_mapping),
        query_start_loc=inputs.query_start_loc + [last + i for i in range(1, num_padding + 1)],
        seq_lens=inputs.seq_lens + [last_position + 1] * num_padding,
        block_table=repeat(inputs.block_table),
        num_padding=num_padding,
        group_slot_mappings=_repeat_last(inputs.group_slot_mappings, num_padding),
        group_block_tables=_repeat_last(inputs.group_block_tables, num_padding),
    )


def _repeat_last(t: torch.Tensor | None, num_padding: int) -> torch.Tensor | None:
    """[G, N, ...] with each group's last row repeated ``num_padding`` times along N."""
    if t is None:
        return None
    return torch.cat([t, t[:, -1:].expand(t.shape[0], num_padding, *t.shape[2:])], dim=1).contiguous()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

