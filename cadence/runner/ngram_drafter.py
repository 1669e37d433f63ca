"""Prompt-lookup (n-gram) drafting: guess the next tokens by finding the
sequence's last n tokens earlier in the sequence and copying what followed.

    tokens   ... a b c x y ... a b c |        (n = 3, pattern "a b c")
                       ^^^ proposal: "x y ..." (up to k tokens)

Longer patterns are tried first (they predict better); among equal-length
matches the most recent one wins, since repetition in generated text tends
to be local.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramDrafter:
    """Proposes up to ``num_speculative_tokens`` drafts from the sequence itself."""

    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"min_n: must be >= 1 and <= max_n ({max_n}), got {min_n}")
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(
        self, token_ids: np.ndarray | list[int], max_tokens: int | None = None
    ) -> list[int]:
        """Drafts continuing ``token_ids`` (at most ``max_tokens``); [] when nothing matches."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        k = self.num_speculative_tokens
        if max_tokens is not None:
            k = min(k, max_tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = _last_earlier_match(tokens, n)
            if start is not None:
                return tokens[start + n : start + n + k].tolist()
        return []


def _last_earlier_match(tokens: np.ndarray, n: int) -> int | None:
    """Start of the latest occurrence of the last n tokens that ends before the last token."""
    pattern = tokens[-n:]
    # Candidate starts 0 .. len-n-1: each match is followed by at least one token.
    windows = sliding_window_view(tokens[:-1], n)  # [len - n, n]
    matches = np.flatnonzero((windows == pattern).all(axis=1))
    if len(matches) == 0:
        return None
    return int(matches[-1])
