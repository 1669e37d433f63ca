"""The grammar bitmask in the runner: unpacking words, mapping rows, masking
logits, and reviving rows whose only allowed tokens were suppressed stops."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cadence.runner.grammar_mask import (
    allowed_tokens,
    apply_grammar_bitmask,
    grammar_rows,
    revive_dead_rows,
)

NEG_INF = float("-inf")
INT32 = st.integers(-(2**31), 2**31 - 1)


def naive_allowed(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size], one bit at a time: token t is bit t % 32 of word t // 32."""
    rows = []
    for row in words.tolist():
        unsigned = [word & 0xFFFFFFFF for word in row]
        rows.append([t < 32 * len(row) and bool(unsigned[t // 32] >> (t % 32) & 1)
                     for t in range(vocab_size)])
    return torch.tensor(rows, dtype=torch.bool)


def pack(allowed_ids: list[set[int]], num_words: int) -> torch.Tensor:
    """int32 words [len(allowed_ids), num_words] allowing exactly ``allowed_ids[row]``."""
    words = torch.zeros(len(allowed_ids), num_words, dtype=torch.int64)
    for row, token_ids in enumerate(allowed_ids):
        for t in token_ids:
            words[row, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


# ------------------------------------------------------------ allowed_tokens


@pytest.mark.parametrize("vocab_size", [70, 96, 130], ids=["ragged", "exact", "wider-than-words"])
def test_allowed_tokens_matches_a_bit_by_bit_decode(vocab_size):
    generator = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31, (5, 3), dtype=torch.int32, generator=generator)
    words[0] = torch.tensor([-1, 0, -(2**31)], dtype=torch.int32)  # all, none, only bit 31
    allowed = allowed_tokens(words, vocab_size)
    assert allowed.dtype == torch.bool and allowed.shape == (5, vocab_size)
    assert torch.equal(allowed, naive_allowed(words, vocab_size))
    assert (words < 0).any()  # bit 31 set somewhere besides row 0
    if vocab_size > 96:
        assert not allowed[:, 96:].any()


def test_allowed_tokens_reads_bit_31_as_the_last_token_of_its_word():
    words = pack([{31, 32, 95}], num_words=3)
    assert words[0, 0].item() == -(2**31)
    assert allowed_tokens(words, 100)[0].nonzero().flatten().tolist() == [31, 32, 95]


@settings(max_examples=200, deadline=None)
@given(data=st.data(), num_rows=st.integers(1, 4), num_words=st.integers(1, 4))
def test_allowed_tokens_matches_a_bit_by_bit_decode_on_any_words(data, num_rows, num_words):
    values = data.draw(st.lists(INT32, min_size=num_rows * num_words, max_size=num_rows * num_words))
    vocab_size = data.draw(st.integers(1, 32 * num_words + 40))
    words = torch.tensor(values, dtype=torch.int32).reshape(num_rows, num_words)
    assert torch.equal(allowed_tokens(words, vocab_size), naive_allowed(words, vocab_size))


# ------------------------------------------------------------ grammar_rows


def test_grammar_rows_follows_each_requests_drafts():
    # logits rows:  a: 0 | b: 1 2 3 | c: 4 5        mask rows: a: 0 | c: 1 2
    assert grammar_rows(["a", "b", "c"], [1, 3, 2], {"a": 0, "c": 1}) == ([0, 4, 5], [0, 1, 2])
    assert grammar_rows(["a", "b", "c"], [1, 3, 2], {"b": 0}) == ([1, 2, 3], [0, 1, 2])
    assert grammar_rows(["a", "b", "c"], [1, 3, 2], {"c": 0, "a": 2}) == ([0, 4, 5], [2, 0, 1])


def test_grammar_rows_without_structured_requests_is_empty():
    assert grammar_rows(["a", "b"], [1, 2], {}) == ([], [])
    assert grammar_rows([], [], {}) == ([], [])


# ------------------------------------------------------------ apply_grammar_bitmask


def random_logits(num_rows: int, vocab_size: int) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(1))


def random_words(num_rows: int, num_words: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(2)
    return torch.randint(-(2**31), 2**31, (num_rows, num_words), dtype=torch.int32, generator=generator)


def test_apply_grammar_bitmask_on_every_row():
    logits, bitmask = random_logits(4, 70), random_words(4, 3)
    original = logits.clone()
    mask_rows = [2, 0, 3, 1]
    allowed = apply_grammar_bitmask(logits, bitmask, [0, 1, 2, 3], mask_rows)
    expected_allowed = naive_allowed(bitmask[mask_rows], 70)
    assert torch.equal(allowed, expected_allowed)
    assert torch.equal(logits, original.masked_fill(~expected_allowed, NEG_INF))


def test_apply_grammar_bitmask_on_some_rows_leaves_the_others():
    logits, bitmask = random_logits(5, 70), random_words(2, 3)
    original = logits.clone()
    allowed = apply_grammar_bitmask(logits, bitmask, [1, 3], [1, 0])
    expected_allowed = naive_allowed(bitmask[[1, 0]], 70)
    assert torch.equal(allowed, expected_allowed)
    for row in (0, 2, 4):
        assert torch.equal(logits[row], original[row])
    assert torch.equal(logits[1], original[1].masked_fill(~expected_allowed[0], NEG_INF))
    assert torch.equal(logits[3], original[3].masked_fill(~expected_allowed[1], NEG_INF))


def test_apply_grammar_bitmask_refuses_logits_past_the_words():
    logits = random_logits(1, 100)
    allowed = apply_grammar_bitmask(logits, pack([{0, 95}], num_words=3), [0], [0])
    assert allowed[0].nonzero().flatten().tolist() == [0, 95]
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 95]


def test_apply_grammar_bitmask_without_rows_does_nothing():
    logits = random_logits(2, 70)
    original = logits.clone()
    assert apply_grammar_bitmask(logits, random_words(2, 3), [], []) is None
    assert torch.equal(logits, original)


# ------------------------------------------------------------ revive_dead_rows


def test_revive_dead_rows_gives_back_only_the_stops_the_grammar_allowed():
    vocab_size, stop_ids = 40, [2, 7]
    logits = random_logits(4, vocab_size)
    logits[0] = NEG_INF  # not a grammar row: dead, but none of this function's business
    # Grammar rows 1, 2 and 3: row 1 allows only the stop 2 (not 7); row 2 allows
    # stops and text; row 3 allows only 7, which is not a stop of its request.
    bitmask = pack([{2}, {2, 7, 11, 12}, {7}], num_words=2)
    allowed = apply_grammar_bitmask(logits, bitmask, [1, 2, 3], [0, 1, 2])
    logits[1:, stop_ids] = NEG_INF  # min_tokens not reached: stops suppressed
    before = logits.clone()

    revive_dead_rows(logits, [1, 2, 3], allowed, [stop_ids, stop_ids, [2]])

    assert logits[1, 2].item() == 0.0
    assert logits[1, 7].item() == NEG_INF
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [2]
    assert torch.equal(logits[2], before[2])  # live: 11 and 12 are still finite
    assert torch.equal(logits[3], before[3])  # dead, but nothing the grammar allowed to revive
    assert torch.equal(logits[0], before[0])


def test_revive_dead_rows_without_rows_does_nothing():
    logits = torch.full((1, 8), NEG_INF)
    revive_dead_rows(logits, [], torch.ones(0, 8, dtype=torch.bool), [])
    assert not torch.isfinite(logits).any()
