"""Tensor parallelism: one decoder split over K ranks (Megatron-style).

Each rank holds 1/K of every matmul and computes on it; two all-reduces
per layer put the pieces back together:

    embed     vocabulary rows [r*V/K, (r+1)*V/K): a rank looks up the tokens
              it holds, zeros for the rest ------------------------------ all-reduce
    attention qkv_proj column-parallel: the rank's Hq/K query heads and Hkv/K
              kv heads (its KV cache holds those heads only) -> attention ->
              o_proj row-parallel: partial sums of hidden --------------- all-reduce
    MLP       gate_up_proj column-parallel (I/K of gate, I/K of up) ->
              act -> down_proj row-parallel: partial sums of hidden ----- all-reduce
    LM head   vocabulary rows as the embedding: logits of V/K tokens ---- all-gather

Norms, rotary and residual adds are replicated: every rank holds the whole
hidden state between blocks. A vocabulary that K does not divide is padded
to K * ceil(V/K) rows of zeros; the padded logits are cut off after the gather.

    check_tensor_parallel(config, K)        ValueError for what cannot be split
    weights = shard_weights(model, r, K)    rank r's slices of a loaded model
    shard = build_shard(config, group, dtype, weights)

Refused: mixture-of-experts MLPs (experts would be split, not heads) and
q/k norms over the whole projection (OLMo 2: the norm would need every rank's heads).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from cadence.models.config import ModelConfig
from cadence.models.layers import Embedding, FusedLinear, Linear
from cadence.models.llama import LlamaForCausalLM
from cadence.models.tp_group import TensorParallelGroup

if TYPE_CHECKING:
    from cadence.models.step_buffer import StepBuffer

# Linears whose input is split (the heads' outputs, the MLP's intermediate).
ROW_PARALLEL = ("o_proj", "down_proj")


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """ValueError naming tensor_parallel_size when ``config``'s model cannot be split ``size`` ways."""
    if size == 1:
        return
    prefix = f"tensor_parallel_size {size}: {config.architecture}"
    if config.num_experts:
        raise ValueError(f"{prefix} is a mixture of experts, which tensor parallelism does not split")
    if config.qk_norm == "whole":
        raise ValueError(f"{prefix} norms q and k over all heads at once, which a rank "
                         f"holding some heads cannot compute")
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % size:
            raise ValueError(f"{prefix} has {name} {value}, which {size} ranks cannot split "
                             f"evenly (tensor_parallel_size must divide it)")


def rank_config(config: ModelConfig, size: int) -> ModelConfig:
    """What one rank's layers and KV cache hold: 1/size of the heads and of the MLP."""
    return config.replace(num_attention_heads=config.num_attention_heads // size,
                          num_key_value_heads=config.num_key_value_heads // size,
                          intermediate_size=config.intermediate_size // size)


# ------------------------------------------------------------ layers


class RowParallelLinear(Linear):
    """A linear over this rank's slice of the input features; the ranks'
    partial products are summed (one all-reduce), so every rank gets ``x @ W.T``."""

    def __init__(self, in_features: int, out_features: int, *, dtype: torch.dtype,
                 group: TensorParallelGroup) -> None:
        super().__init__(in_features, out_features, bias=False, dtype=dtype)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x).contiguous())


class VocabParallelEmbedding(Embedding):
    """This rank's rows [start, start + rows) of the embedding table; a token
    outside them looks up zeros, and the all-reduce fills in the owner's row."""

    def __init__(self, rows: int, hidden_size: int, *, dtype: torch.dtype,
                 group: TensorParallelGroup) -> None:
        super().__init__(rows, hidden_size, dtype=dtype)
        self.group = group
        self.start = group.rank * rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local_ids = input_ids - self.start
        outside = (local_ids < 0) | (local_ids >= self.weight.shape[0])  # [T]
        hidden = F.embedding(local_ids.masked_fill(outside, 0), self.weight)  # [T, hidden]
        return self.group.all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0))


class VocabParallelHead(Linear):
    """The LM head's rows for this rank's vocabulary slice; the logits of all
    ranks are gathered, so every rank gets all ``vocab_size`` of them."""

    def __init__(self, hidden_size: int, rows: int, vocab_size: int, *, dtype: torch.dtype,
                 group: TensorParallelGroup) -> None:
        super().__init__(hidden_size, rows, bias=False, dtype=dtype)
        self.group = group
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor, buffer: StepBuffer | None = None) -> torch.Tensor:
        parts = self.group.all_gather(super().forward(x, buffer))  # size x [N, rows]
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]  # [N, vocab]


# ------------------------------------------------------------ weights


def vocab_rows_per_rank(vocab_size: int, size: int) -> int:
    return -(-vocab_size // size)


def shard_weights(model: LlamaForCausalLM, rank: int, size: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s part of every parameter of a loaded (unpacked) model,
    named as in ``build_shard``'s model, as compact copies (safe to pickle)."""
    weights: dict[str, torch.Tensor] = {}
    for path, module in model.named_modules():
        for kind, param in module.named_parameters(recurse=False):
            name = f"{path}.{kind}" if path else kind
            weights[name] = _slice(path, module, param.data, rank, size).clone()
    return weights


def _slice(path: str, module: torch.nn.Module, data: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    leaf = path.rpartition(".")[2]
    if isinstance(module, FusedLinear):  # each projection's rows split alike: q|k|v, gate|up
        return torch.cat([rows.chunk(size)[rank] for rows in data.split(module.shard_sizes)])
    if leaf in ROW_PARALLEL:
        return data.chunk(size, dim=1)[rank]
    if isinstance(module, Embedding) or path == "lm_head":
        return _vocab_slice(data, rank, size)
    return data  # norms: every rank holds them whole


def _vocab_slice(table: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rows [rank * R, (rank + 1) * R) of ``table``, R = ceil(V / size), zero-padded past V."""
    rows = vocab_rows_per_rank(table.shape[0], size)
    piece = table[rank * rows : (rank + 1) * rows]
    if piece.shape[0] == rows:
        return piece
    padded = table.new_zeros(rows, table.shape[1])
    padded[: piece.shape[0]] = piece
    return padded


def build_shard(config: ModelConfig, group: TensorParallelGroup, dtype: torch.dtype,
                weights: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    """Rank ``group.rank``'s model of ``config`` (the full model's config), filled with ``weights``."""
    check_tensor_parallel(config, group.size)
    model = LlamaForCausalLM(rank_config(config, group.size), dtype)
    rows = vocab_rows_per_rank(config.vocab_size, group.size)
    model.model.embed_tokens = VocabParallelEmbedding(rows, config.hidden_size, dtype=dtype, group=group)
    if model.lm_head is not None:
        model.lm_head = VocabParallelHead(config.hidden_size, rows, config.vocab_size, dtype=dtype, group=group)
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        attention.o_proj = _row_parallel(attention.o_proj, dtype, group)
        mlp.down_proj = _row_parallel(mlp.down_proj, dtype, group)
    model.load_state_dict(weights, strict=True)
    if model.lm_head is None:  # tied: the head reads this rank's embedding rows
        model.lm_head = VocabParallelHead(config.hidden_size, rows, config.vocab_size, dtype=dtype, group=group)
        # Its own Parameter over the same storage: packing the head leaves the table whole.
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.data, requires_grad=False)
    return model.eval()


def _row_parallel(linear: Linear, dtype: torch.dtype, group: TensorParallelGroup) -> RowParallelLinear:
    return RowParallelLinear(linear.in_features, linear.out_features, dtype=dtype, group=group)
