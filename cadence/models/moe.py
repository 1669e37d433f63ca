"""Mixture-of-experts feed-forward (Qwen3-MoE): a router picks k experts per token.

    router logits [T, E] -> softmax (float32) -> top-k weights and expert ids [T, k]
    (weights renormalised to sum to 1 with ``norm_topk_prob``)
    out[t] = sum over its k experts e of weight * down_e(silu(gate_e(x[t])) * up_e(x[t]))

The experts run batched: the T*k (token, expert) pairs are sorted by expert,
so each expert that got any token does one matmul over all of its rows
(a loop over experts, never over tokens):

    pairs sorted by expert:  [ e0: t3 t7 | e1: t0 | e3: t0 t3 t5 | ... ]
    rows   = x[token of each pair]                 [T*k, H]
    outs   = expert e's MLP on its run of rows     [T*k, H]
    out    = index_add over tokens of weight * outs

Experts live as dense float stacks, or, loaded from a GGUF whose expert
tensors are of a quantized kernel's type, as each expert's rows of those
blocks (``Experts.keep_quantized``): the products then run on the blocks.

With float32 fused ops (``FusedOps``, the CPU's C library) the router's
product (for a float router), the routing and the combining run in C
(``linear``, ``moe_route``, ``moe_combine``): top-k ties go to the lower
expert id, and each token's output sums its picks in pick order, exactly as
the one-call decoder (``decoder_stack.c``) computes them, so the two agree
to the bit. Without fused ops (the GPU, bfloat16) it is PyTorch throughout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from cadence.models import quantized
from cadence.models.layers import Linear, empty_parameter
from cadence.models.quantized import Part

if TYPE_CHECKING:
    from cadence.kernels.fused_ops import FusedOps
    from cadence.kernels.quant_matmul import QuantMatmul


class Experts(torch.nn.Module):
    """E SwiGLU experts stored stacked: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].

    After ``keep_quantized`` each expert's matrices are parts (``quantized``'s
    row ranges: gate|up in one or two parts, down in one) and the stacks are empty.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up_proj = empty_parameter(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype)
        self.down_proj = empty_parameter(num_experts, hidden_size, intermediate_size, dtype=dtype)
        # Per expert, after keep_quantized: gate|up's parts and down's.
        self.gate_up_parts: tuple[tuple[Part, ...], ...] | None = None
        self.down_parts: tuple[tuple[Part, ...], ...] | None = None
        self.quant_kernel: QuantMatmul | None = None  # see LlamaForCausalLM.use_quant_kernel

    def checkpoint_tensors(self, path: str) -> dict[str, torch.Tensor]:
        """Hugging Face's per-expert names (``<path>.3.up_proj.weight``) -> our rows of them."""
        size = self.intermediate_size
        views = {}
        for e in range(self.num_experts):
            gate_up = self.gate_up_proj.data[e]
            views[f"{path}.{e}.gate_proj.weight"] = gate_up[:size]
            views[f"{path}.{e}.up_proj.weight"] = gate_up[size:]
            views[f"{path}.{e}.down_proj.weight"] = self.down_proj.data[e]
        return views

    def keep_quantized(self, shards: list[Part]) -> None:
        """Hold the experts as ``shards`` (gate, up, down of expert 0, then of expert 1, ...,
        as ``checkpoint_tensors`` names them; quantized or float) instead of the stacks."""
        if len(shards) != 3 * self.num_experts:
            raise ValueError(f"keep_quantized: {len(shards)} shards for {self.num_experts} experts' gate, up, down")
        self.gate_up_parts = tuple(quantized.merge_parts(shards[3 * e:3 * e + 2]) for e in range(self.num_experts))
        self.down_parts = tuple((shards[3 * e + 2],) for e in range(self.num_experts))
        self.gate_up_proj.data = self.gate_up_proj.data.new_empty(0)
        self.down_proj.data = self.down_proj.data.new_empty(0)

    @property
    def quantized(self) -> tuple[Part, ...] | None:
        """Every expert's parts (see ``LlamaForCausalLM.quantized_weights``); None while stacked."""
        if self.gate_up_parts is None:
            return None
        return tuple(part for gate_up, down in zip(self.gate_up_parts, self.down_parts) for part in (*gate_up, *down))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                ops: "FusedOps | None" = None) -> torch.Tensor:
        """x [T, H]; expert_ids, weights [T, k] -> the weighted sum of each token's experts [T, H].
        With ``ops`` (float32 C routing) silu*up and the sum run in C, the sum in pick order."""
        num_picks = expert_ids.shape[1]
        order = expert_ids.flatten().argsort(stable=True)  # [T*k] pairs grouped by expert
        token_of_pair = order // num_picks  # [T*k]
        counts = torch.bincount(expert_ids.flatten(), minlength=self.num_experts).tolist()
        rows = x.index_select(0, token_of_pair)  # [T*k, H]
        outs = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                outs[start:start + count] = self._expert(expert, rows[start:start + count], ops)
                start += count
        if ops is not None:
            pair_rows = torch.empty_like(order)  # [T*k]: pair t*k + j's row of outs
            pair_rows[order] = torch.arange(order.shape[0])
            return ops.moe_combine(outs, pair_rows.view(expert_ids.shape), weights)
        outs *= weights.flatten()[order].unsqueeze(1)
        return torch.zeros_like(x).index_add_(0, token_of_pair, outs)

    def _expert(self, expert: int, rows: torch.Tensor, ops: "FusedOps | None") -> torch.Tensor:
        if self.gate_up_parts is None:
            gate_up = F.linear(rows, self.gate_up_proj[expert])  # [n, 2I]
        else:
            gate_up = quantized.linear(rows, self.gate_up_parts[expert], None, self.quant_kernel)
        if ops is not None:
            act = ops.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)  # [n, I] each
            act = F.silu(gate) * up
        if self.down_parts is None:
            return F.linear(act, self.down_proj[expert])  # [n, H]
        return quantized.linear(act, self.down_parts[expert], None, self.quant_kernel)


class Router(Linear):
    """The router's [E, H] product: a ``Linear`` never packed for oneDNN, so that with float32
    fused ops its float weight is there for the C product both decode paths share."""

    def pack(self) -> bool:
        return False

    def logits(self, x: torch.Tensor, ops: "FusedOps") -> torch.Tensor:
        """float32 router logits [T, E] as the one-call decoder computes them."""
        if self.quantized is None and self.lora is None and self.bias is None:
            return ops.linear(x.contiguous(), self.weight)
        return self(x).float()


class SparseMoE(torch.nn.Module):
    """Router (``gate``, [E, H]) plus ``experts``; named as in Hugging Face's Qwen3-MoE."""

    def __init__(self, hidden_size: int, num_experts: int, num_experts_per_tok: int,
                 intermediate_size: int, *, norm_topk_prob: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = num_experts_per_tok, norm_topk_prob
        self.gate = Router(hidden_size, num_experts, bias=False, dtype=dtype)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, dtype=dtype)
        self.fused_ops: FusedOps | None = None  # see LlamaForCausalLM.use_fused_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.fused_ops
        if ops is not None and "moe_route" in ops.OPERATIONS and x.dtype == torch.float32:  # the CPU's ops only
            weights, expert_ids = ops.moe_route(self.gate.logits(x, ops), self.top_k, self.norm_topk_prob)
            return self.experts(x.contiguous(), expert_ids, weights, ops)
        probs = F.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        weights, expert_ids = probs.topk(self.top_k, dim=-1)  # [T, k] each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, expert_ids, weights.to(x.dtype))
