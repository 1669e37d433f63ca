"""Per-token building blocks of the decoder: embedding, linear, RMSNorm, gated MLP.

Parameters are allocated uninitialised (``torch.empty``): a model is always
filled by a loader (or ``cadence.models.testing.randomize``), and skipping
PyTorch's default initialisation saves seconds per billion weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, overload

import torch
import torch.nn.functional as F

from cadence.kernels import packed_weights
from cadence.models import quantized
from cadence.models.quantized import Part, QuantizedTensor

if TYPE_CHECKING:
    from cadence.kernels.fused_ops import FusedOps
    from cadence.kernels.quant_matmul import QuantMatmul
    from cadence.models.lora_layers import LinearLoRA
    from cadence.models.step_buffer import StepBuffer


def empty_parameter(*shape: int, dtype: torch.dtype) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Embedding(torch.nn.Module):
    """Token embedding table, weight [vocab, hidden].

    After ``keep_quantized`` the table stays in GGUF blocks (``quantized``)
    and a lookup decodes its rows; ``weight`` is left empty (it keeps the dtype).
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_parameter(vocab_size, hidden_size, dtype=dtype)
        self.quantized: QuantizedTensor | None = None
        self.quant_kernel: QuantMatmul | None = None  # see LlamaForCausalLM.use_quant_kernel

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return quantized.embedding(input_ids, self.quantized, self.quant_kernel, self.weight.dtype)
        return F.embedding(input_ids, self.weight)  # [T] -> [T, hidden]

    def keep_quantized(self, shards: list[Part]) -> None:
        """Hold the table as the one quantized shard ``shards`` holds."""
        (table,) = shards
        self.quantized = table
        self.weight.data = self.weight.data.new_empty(0)


class Linear(torch.nn.Module):
    """``y = x @ W.T (+ b)`` with W [out_features, in_features].

    After ``pack()`` (CPU only, see ``packed_weights``) the product runs on
    oneDNN's packed copy and ``weight`` is left empty; after ``keep_quantized``
    it runs on GGUF blocks (see ``quantized``), ``weight`` empty too. With LoRA adapters
    (``lora``, see ``lora_layers``) each token's adapter delta is added to
    whichever product ran.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = empty_parameter(out_features, in_features, dtype=dtype)
        self.bias = empty_parameter(out_features, dtype=dtype) if bias else None
        self.packed_weight: torch.Tensor | None = None
        self.quantized: tuple[Part, ...] | None = None  # row ranges of W, see keep_quantized
        self.quant_kernel: QuantMatmul | None = None  # see LlamaForCausalLM.use_quant_kernel
        self.lora: LinearLoRA | None = None

    def forward(self, x: torch.Tensor, buffer: "StepBuffer | None" = None) -> torch.Tensor:
        """``buffer``: where a product on GGUF blocks may be written (see ``StepBuffer``)."""
        if self.quantized is not None:
            y = quantized.linear(x, self.quantized, self.bias, self.quant_kernel, buffer)
        elif self.packed_weight is not None:
            y = packed_weights.packed_linear(x, self.packed_weight, self.bias)
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora.apply(x, y)

    def pack(self) -> bool:
        """Move the weight into oneDNN's packed layout; False where it cannot be."""
        if self.packed_weight is not None or self.quantized is not None \
                or not packed_weights.can_pack(self.weight):
            return False
        self.packed_weight = packed_weights.pack(self.weight)
        self.weight.data = self.weight.data.new_empty(0)  # the packed copy is the only one
        return True

    def keep_quantized(self, shards: list[Part]) -> None:
        """Hold W as ``shards`` (its row ranges in order; quantized or float) instead of ``weight``."""
        if sum(shard.shape[0] for shard in shards) != self.out_features:
            raise ValueError(f"keep_quantized: shards of {[tuple(s.shape) for s in shards]} do not "
                             f"make the {self.out_features} rows of this layer")
        self.quantized = quantized.merge_parts(shards)
        self.weight.data = self.weight.data.new_empty(0)


class FusedLinear(Linear):
    """Several projections of the same input stacked by rows, computed as one matmul.

    ``shards`` lists (checkpoint name, rows) in row order, e.g. q_proj, k_proj, v_proj.
    ``checkpoint_fused``: the checkpoint stores the stacked matrix under this
    module's own name (Phi-3's qkv_proj), not one tensor per shard.
    """

    def __init__(self, in_features: int, shards: list[tuple[str, int]], *, bias: bool, dtype: torch.dtype,
                 checkpoint_fused: bool = False) -> None:
        self.shard_names = tuple(name for name, _ in shards)
        self.shard_sizes = tuple(rows for _, rows in shards)
        self.checkpoint_fused = checkpoint_fused
        super().__init__(in_features, sum(self.shard_sizes), bias=bias, dtype=dtype)

    def checkpoint_tensors(self, path: str) -> dict[str, torch.Tensor]:
        """Checkpoint name -> the rows of our parameter it fills, for this module at ``path``."""
        params = {kind: param.data for kind, param in self.named_parameters()}
        if self.checkpoint_fused:
            return {f"{path}.{kind}": data for kind, data in params.items()}
        parent = path.rpartition(".")[0]
        return {f"{parent}.{shard}.{kind}": rows
                for kind, data in params.items()
                for shard, rows in zip(self.shard_names, data.split(self.shard_sizes))}

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The projections of x, one tensor per shard."""
        return self.forward(x).split(self.shard_sizes, dim=-1)


class _NormWeight:
    """The weight a fused kernel scales by: the norm's own, or ``offset + weight``
    in float32 (Gemma's), computed once per value of the weight."""

    weight: torch.Tensor
    weight_offset: float

    def fused_weight(self) -> torch.Tensor:
        if not self.weight_offset:
            return self.weight
        key = (self.weight.data_ptr(), self.weight._version, self.weight.device)
        if getattr(self, "_offset_key", None) != key:
            self._offset_weight = self.weight_offset + self.weight.float()
            self._offset_key = key
        return self._offset_weight

    def fuses(self, x: torch.Tensor, ops: "FusedOps") -> bool:
        """Whether ``ops`` norms x as the reference does: always without an
        offset; with one only in float32, where Gemma's ``normed * (offset +
        weight)`` in float32 then cast rounds once (and only where ``ops``
        says it takes offset weights: the GPU's twin leaves them to PyTorch)."""
        return not self.weight_offset or (x.dtype == torch.float32 and "offset_rms_norm" in ops.OPERATIONS)


class RMSNorm(_NormWeight, torch.nn.Module):
    """Root-mean-square norm, computed in float32 and cast back before the weight.

    ``forward(x, residual)`` first adds x into the residual stream and norms
    the sum, returning ``(normed, new residual)``, so a decoder layer makes
    one call where it would make two (one pass in C with ``fused_ops``).
    """

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_parameter(hidden_size, dtype=dtype)
        self.weight_offset = weight_offset  # see ModelConfig.norm_weight_offset
        self.fused_ops: FusedOps | None = None  # see LlamaForCausalLM.use_fused_ops

    @overload
    def forward(self, x: torch.Tensor) -> torch.Tensor: ...
    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(self, x, residual=None):
        if self.fused_ops is not None and self.fuses(x, self.fused_ops):
            # residual += x happens in place: the stream is this forward's own tensor.
            normed = self.fused_ops.rms_norm(x, self.fused_weight(), self.eps, residual)
            return normed if residual is None else (normed, residual)
        if residual is not None:
            residual = residual + x
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.weight_offset)


class HeadRMSNorm(_NormWeight, torch.nn.Module):
    """RMSNorm of q or k over their last dimension.

    Over each head ([T, H, D], Qwen3, Gemma 3) or over the whole projection
    ([T, H*D], OLMo 2). q/k here are row-strided slices of the fused qkv
    output: with ``fused_ops`` they are normed in place there, in one C pass.
    """

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_parameter(size, dtype=dtype)
        self.weight_offset = weight_offset
        self.fused_ops: FusedOps | None = None  # see LlamaForCausalLM.use_fused_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.fused_ops
        if ops is not None and "head_rms_norm" in ops.OPERATIONS and self.fuses(x, ops):
            ops.head_rms_norm_(x if x.dim() == 3 else x.unsqueeze(1), self.fused_weight(), self.eps)
            return x
        return rms_norm(x, self.weight, self.eps, self.weight_offset)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float) -> torch.Tensor:
    """RMSNorm of x over its last dimension, in float32.

    Without an offset the normed values are cast back before the weight
    (Llama); with one, ``normed * (offset + weight)`` is computed in float32
    and then cast (Gemma), each as its reference does it.
    """
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    if not weight_offset:
        return weight * normed.to(x.dtype)
    return (normed * (weight_offset + weight.float())).to(x.dtype)


class GatedMLP(torch.nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``; GeGLU with ``activation="gelu_tanh"``.

    gate and up are one fused projection: rows [0, I) are gate, [I, 2I) are up.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype: torch.dtype,
                 checkpoint_fused: bool = False, activation: str = "silu") -> None:
        super().__init__()
        self.activation = activation
        shards = [("gate_proj", intermediate_size), ("up_proj", intermediate_size)]
        self.gate_up_proj = FusedLinear(hidden_size, shards, bias=False, dtype=dtype,
                                        checkpoint_fused=checkpoint_fused)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)
        self.fused_ops: FusedOps | None = None  # see LlamaForCausalLM.use_fused_ops
        self.row_slice: int | None = None  # most rows at a time (see slice_feed_forwards)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, most = x.shape[0], self.row_slice
        if most is None or rows <= most or self._has_adapted_rows():
            return self._rows(x)
        # Even slices (2,049 rows: 5 of 410, not a last one of 1 row on another product path).
        return torch.cat([self._rows(part) for part in x.tensor_split(-(-rows // most))])

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        fused = _FUSED_ACTIVATIONS[self.activation]
        if self.fused_ops is not None and fused in self.fused_ops.OPERATIONS:
            return self.down_proj(getattr(self.fused_ops, fused)(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj.forward_split(x)  # [T, I] each
        return self.down_proj(_ACTIVATIONS[self.activation](gate) * up)

    def _has_adapted_rows(self) -> bool:
        """Whether a LoRA adapter has rows in this step: its mapping indexes the
        step's whole batch, so those rows are not sliced."""
        return any(proj.lora is not None and proj.lora.mapping.token_rows is not None
                   for proj in (self.gate_up_proj, self.down_proj))


def slice_feed_forwards(model: torch.nn.Module, rows: int | None) -> None:
    """Run each gated feed-forward of ``model`` on at most ``rows`` rows at a time (None: all at once)."""
    for module in model.modules():
        if isinstance(module, GatedMLP):
            module.row_slice = rows


_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
# The fused operation (``FusedOps.OPERATIONS``) computing activation(gate) * up.
_FUSED_ACTIVATIONS = {"silu": "silu_mul", "gelu_tanh": "gelu_tanh_mul"}
