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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cadence.models.layers import Linear, empty_parameter


class Experts(torch.nn.Module):
    """E SwiGLU experts stored stacked: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up_proj = empty_parameter(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype)
        self.down_proj = empty_parameter(num_experts, hidden_size, intermediate_size, dtype=dtype)

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

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; expert_ids, weights [T, k] -> the weighted sum of each token's experts [T, H]."""
        num_picks = expert_ids.shape[1]
        order = expert_ids.flatten().argsort(stable=True)  # [T*k] pairs grouped by expert
        token_of_pair = order // num_picks  # [T*k]
        counts = torch.bincount(expert_ids.flatten(), minlength=self.num_experts).tolist()
        rows = x.index_select(0, token_of_pair)  # [T*k, H]
        outs = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                outs[start:start + count] = self._expert(expert, rows[start:start + count])
                start += count
        outs *= weights.flatten()[order].unsqueeze(1)
        return torch.zeros_like(x).index_add_(0, token_of_pair, outs)

    def _expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, self.gate_up_proj[expert]).chunk(2, dim=-1)  # [n, I] each
        return F.linear(F.silu(gate) * up, self.down_proj[expert])  # [n, H]


class SparseMoE(torch.nn.Module):
    """Router (``gate``, [E, H]) plus ``experts``; named as in Hugging Face's Qwen3-MoE."""

    def __init__(self, hidden_size: int, num_experts: int, num_experts_per_tok: int,
                 intermediate_size: int, *, norm_topk_prob: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = num_experts_per_tok, norm_topk_prob
        self.gate = Linear(hidden_size, num_experts, bias=False, dtype=dtype)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        weights, expert_ids = probs.topk(self.top_k, dim=-1)  # [T, k] each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, expert_ids, weights.to(x.dtype))
