"""Structured outputs in the runner: the step's grammar bitmask applied to the logits.

The scheduler's bitmask has one row per logits row of each structured
request (1 + its drafts, see ``StepPlan.structured_output_request_ids``):
bit ``t % 32`` of word ``t // 32`` set allows token ``t``. A disallowed
token's logit becomes -inf before penalties, temperature and top-k/top-p,
so greedy and sampled rows alike pick only what the grammar accepts.
"""

from __future__ import annotations

import numpy as np
import torch


def grammar_rows(
    req_ids: list[str], num_rows: list[int], first_mask_row: dict[str, int]
) -> tuple[list[int], list[int]]:
    """(logits rows, bitmask rows) of the structured requests among ``req_ids``.

    ``req_ids[k]`` owns ``num_rows[k]`` consecutive logits rows, in order.
    """
    logits_rows: list[int] = []
    mask_rows: list[int] = []
    row = 0
    for req_id, count in zip(req_ids, num_rows):
        first = first_mask_row.get(req_id)
        if first is not None:
            logits_rows.extend(range(row, row + count))
            mask_rows.extend(range(first, first + count))
        row += count
    return logits_rows, mask_rows


def allowed_tokens(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size] from int32 words [rows, W]; tokens past 32 * W are refused."""
    # Little-endian bytes, least significant bit first: bit i of word w is token 32 w + i.
    packed = np.ascontiguousarray(words.numpy()).view(np.uint8)
    count = min(vocab_size, packed.shape[1] * 8)
    bits = np.unpackbits(packed, axis=1, count=count, bitorder="little").view(np.bool_)
    allowed = torch.from_numpy(bits)
    if count < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - count), value=False)
    return allowed


def apply_grammar_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, logits_rows: list[int], mask_rows: list[int]
) -> torch.Tensor | None:
    """Set to -inf, in place, every logit the grammar refuses at ``logits_rows``;
    returns the allowed tokens of those rows (bool [len(rows), vocab])."""
    if not logits_rows:
        return None
    allowed = allowed_tokens(bitmask[mask_rows], logits.shape[1]).to(logits.device, non_blocking=True)
    refused = allowed.logical_not()
    if len(logits_rows) == logits.shape[0]:  # ascending and distinct (grammar_rows): every row
        logits.masked_fill_(refused, float("-inf"))
    else:
        rows = torch.tensor(logits_rows, device=logits.device)
        logits[rows] = logits[rows].masked_fill_(refused, float("-inf"))
    return allowed


def revive_dead_rows(
    logits: torch.Tensor, logits_rows: list[int], allowed: torch.Tensor, stop_ids: list[list[int]]
) -> None:
    """A grammar row left with no finite logit (the grammar allowed only stops,
    and ``min_tokens`` suppressed them) gets those stops back: the grammar's
    end wins over ``min_tokens``, rather than sampling from nothing.

    ``stop_ids[i]`` are the stop ids of the request owning ``logits_rows[i]``.
    """
    if not logits_rows:
        return
    rows = torch.tensor(logits_rows, device=logits.device)
    dead = (~torch.isfinite(logits[rows]).any(dim=1)).nonzero().flatten().tolist()
    for i in dead:
        revived = [t for t in stop_ids[i] if allowed[i, t]]
        if revived:
            logits[logits_rows[i], revived] = 0.0
