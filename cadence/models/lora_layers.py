"""LoRA as an add-on to any linear layer: ``y = base(x) + (x @ A.T) @ B.T``, per token.

A LoRA-capable ``Linear`` holds a ``LinearLoRA`` beside its weight (whatever
path computes the base product: dense, oneDNN packed, fused q|k|v): the
delta is added to the base output, so every fast path of the base stays.

The tokens of one forward may belong to several adapters and to none (the
base model). The runner describes that once per step in a ``LoRAMapping``,
shared by every layer: the rows that use an adapter, grouped by adapter.

    tokens       t0 t1 t2 t3 t4 t5 t6          adapter of each: 0 7 7 3 0 3 7  (0: base)
    token_rows   [1 2 6 | 3 5]                  rows grouped by adapter (stable)
    segments     (7, 0, 3), (3, 3, 5)           (adapter, start, end) into token_rows

Each layer then makes one gather of the adapted rows, two small matmuls per
adapter on its contiguous segment, and one scatter-add: no per-token Python,
and base rows cost nothing. When every token uses one adapter (the rows are
all of them, in order) the gather and scatter are skipped.

Fused projections (q|k|v, gate|up) take an adapter per shard: its A's are
stacked by rank and its B's placed block-diagonally over the output rows,

    A_cat [R, in] = [A_q; A_k; A_v]          R = r_q + r_k + r_v (targeted shards only)
    B_bd [out, R] = | B_q  0    0   |  rows of q
                    | 0    B_k  0   |  rows of k
                    | 0    0    B_v |  rows of v

so a fused layer's delta is still two matmuls. The scaling (alpha / r) is
folded into B when the adapter is added.

In the batch-invariant mode (``LoRAMapping.min_rows`` > 1, set by the runner)
every adapter's rows take the gathered path, their two products computed on
at least ``min_rows`` rows (``row_padding``): a row's delta is then the same
whichever rows, and how many, share its adapter in the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cadence.models.row_padding import pad_rows_product


@dataclass
class LoRAMapping:
    """Which rows of this forward's tokens use which adapter (see the module doc)."""

    token_rows: torch.Tensor | None = None  # [L] int64, grouped by adapter; None: no adapter
    segments: list[tuple[int, int, int]] = field(default_factory=list)  # (adapter, start, end)
    all_rows: bool = False  # token_rows is every row, in order (one adapter for all)
    min_rows: int = 1  # > 1: batch-invariant products (see the module doc)

    def update(self, token_adapter_ids: torch.Tensor) -> None:
        """From the adapter id of each token ([T] int64, 0 for the base model), in
        place: every layer holds this object."""
        adapted = torch.nonzero(token_adapter_ids).flatten()  # [L]
        if adapted.numel() == 0:
            self.clear()
            return
        ids = token_adapter_ids[adapted]
        order = torch.argsort(ids, stable=True)
        rows, ids = adapted[order], ids[order]
        adapter_ids, counts = torch.unique_consecutive(ids, return_counts=True)
        ends = torch.cumsum(counts, 0).tolist()
        self.segments = list(zip(adapter_ids.tolist(), [0, *ends[:-1]], ends))
        self.token_rows = rows
        self.all_rows = len(self.segments) == 1 and rows.numel() == token_adapter_ids.numel()

    def clear(self) -> None:
        self.token_rows, self.segments, self.all_rows = None, [], False


class LinearLoRA:
    """The adapters of one (possibly fused) linear layer, by adapter id."""

    def __init__(self, in_features: int, shard_sizes: tuple[int, ...], mapping: LoRAMapping) -> None:
        self.in_features = in_features
        self.shard_sizes = shard_sizes
        self.out_features = sum(shard_sizes)
        self.mapping = mapping
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (A_cat, B_bd)

    def add(self, adapter_id: int, shards: dict[int, tuple[torch.Tensor, torch.Tensor]],
            scaling: float) -> None:
        """Shard index -> (A [r, in], B [out_shard, r]) of one adapter (targeted shards only)."""
        first = next(iter(shards.values()))[0]
        a_cat = torch.cat([shards[i][0] for i in sorted(shards)])  # [R, in]
        b_bd = first.new_zeros(self.out_features, a_cat.shape[0])  # [out, R]
        row, col = 0, 0
        for index, size in enumerate(self.shard_sizes):
            if index in shards:
                a, b = shards[index]
                b_bd[row:row + size, col:col + a.shape[0]] = b * scaling
                col += a.shape[0]
            row += size
        self.weights[adapter_id] = (a_cat.contiguous(), b_bd)

    def remove(self, adapter_id: int) -> None:
        self.weights.pop(adapter_id, None)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base output of ``x``, [T, out]) plus each row's adapter delta."""
        mapping = self.mapping
        if mapping.token_rows is None or not self.weights:
            return y
        if mapping.min_rows > 1:
            return self._apply_invariant(x, y)
        if mapping.all_rows:
            weights = self.weights.get(mapping.segments[0][0])
            if weights is not None:
                # The delta rounded to y's dtype, then added, as the mixed batch
                # below does: one fused addmm_ would round once, so a request's
                # tokens under bfloat16 would depend on its batch's adapters.
                y.add_((x @ weights[0].T) @ weights[1].T)  # [T, R] @ [R, out]
            return y
        rows = mapping.token_rows
        xs = x.index_select(0, rows)  # [L, in]
        delta = torch.zeros(rows.numel(), self.out_features, dtype=y.dtype, device=y.device)
        for adapter_id, start, end in mapping.segments:
            weights = self.weights.get(adapter_id)
            if weights is not None:  # an adapter may leave this layer alone
                delta[start:end].addmm_(xs[start:end] @ weights[0].T, weights[1].T)
        return y.index_add_(0, rows, delta)

    def _apply_invariant(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``apply`` with each adapter's products on at least ``mapping.min_rows`` rows."""
        mapping = self.mapping
        for adapter_id, start, end in mapping.segments:
            weights = self.weights.get(adapter_id)
            if weights is None:
                continue
            rows = mapping.token_rows[start:end]
            a_t, b_t = weights[0].T, weights[1].T
            delta = pad_rows_product(lambda xs: (xs @ a_t) @ b_t, x.index_select(0, rows), mapping.min_rows)
            y.index_add_(0, rows, delta)  # [L, in] -> [L, R] -> [L, out]
        return y
