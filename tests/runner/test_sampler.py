"""Sampler and SamplingMetadata: token choice, filters, seeds, penalties, logprobs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cadence.runner.sampler import (
    Sampler,
    apply_penalties,
    compute_prompt_logprobs,
)
from cadence.runner.sampling_metadata import SamplingMetadata, make_generator
from cadence.sampling_params import SamplingParams

# A crafted distribution: p = [0.5, 0.3, 0.15, 0.05].
CRAFTED_PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
CRAFTED_LOGITS = CRAFTED_PROBS.log()


def build(
    params: list[SamplingParams],
    vocab_size: int,
    *,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> SamplingMetadata:
    num_rows = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[] for _ in range(num_rows)],
        outputs if outputs is not None else [[] for _ in range(num_rows)],
        generators if generators is not None else [None] * num_rows,
        vocab_size,
        "cpu",
    )


def sample(logits: torch.Tensor, params: list[SamplingParams], **kwargs):
    return Sampler().sample(logits, build(params, logits.shape[-1], **kwargs))


def draw_many(logits_row: torch.Tensor, params: SamplingParams, num_draws: int) -> torch.Tensor:
    """(num_draws,) tokens: the same row repeated, unseeded, after a fixed global seed."""
    torch.manual_seed(1234)
    logits = logits_row.expand(num_draws, -1).contiguous()
    return sample(logits, [params] * num_draws).sampled_token_ids


def frequencies(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(token_ids, minlength=vocab_size).float() / token_ids.numel()


# ------------------------------------------------------------------ greedy


def test_greedy_is_argmax_and_builds_no_tensors():
    logits = torch.randn(8, 50, generator=make_generator(0))
    params = [SamplingParams(temperature=0.0)] * 8
    metadata = build(params, 50)
    assert metadata.all_greedy and metadata.temperature is None
    assert metadata.no_top_k and metadata.no_top_p and metadata.no_min_p
    assert metadata.no_penalties and metadata.output_token_counts is None
    assert metadata.max_num_logprobs is None

    out = Sampler().sample(logits, metadata)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None and out.sampled_token_ranks is None


def test_greedy_ignores_filters_and_seed():
    logits = torch.randn(4, 30, generator=make_generator(1))
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.3, seed=5)] * 4
    metadata = build(params, 30, generators=[make_generator(5) for _ in range(4)])
    assert metadata.no_top_k and metadata.no_top_p and metadata.no_min_p
    assert metadata.generators == {}
    assert torch.equal(Sampler().sample(logits, metadata).sampled_token_ids, logits.argmax(-1))


def test_temperature_near_zero_behaves_greedy():
    # Gaps of at least 0.1 between logits: at T = 1e-4 the runner-up has
    # probability exp(-1000), so the random path must return the argmax too.
    logits = torch.randperm(40, generator=make_generator(2)).float().mul(0.1).expand(16, -1)
    for temperature in (1e-6, 1e-4):  # below and above GREEDY_EPSILON
        params = [SamplingParams(temperature=temperature)] * 16
        out = sample(logits.contiguous(), params)
        assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_top_k_one_equals_greedy():
    logits = torch.randn(64, 100, generator=make_generator(3))
    params = [SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(64)]
    generators = [make_generator(i) for i in range(64)]
    out = sample(logits, params, generators=generators)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


# ------------------------------------------------------------------ filters


@pytest.mark.parametrize(
    "params, allowed",
    [
        (SamplingParams(top_k=2), [0, 1]),
        (SamplingParams(top_k=3), [0, 1, 2]),
        (SamplingParams(top_p=0.7), [0, 1]),  # 0.5 + 0.3 reaches 0.7
        (SamplingParams(top_p=0.9), [0, 1, 2]),  # drops only the 0.05 tail
        (SamplingParams(min_p=0.2), [0, 1, 2]),  # threshold 0.1 drops 0.05
        (SamplingParams(min_p=0.5), [0, 1]),  # threshold 0.25 drops 0.15 too
        (SamplingParams(top_k=3, top_p=0.6), [0, 1]),  # top-p on the renormalised top-3
        (SamplingParams(top_k=3, min_p=0.4), [0, 1]),
    ],
)
def test_filters_never_sample_a_dropped_token(params, allowed):
    token_ids = draw_many(CRAFTED_LOGITS, params, 8000)
    assert set(token_ids.tolist()) == set(allowed)
    # The survivors keep their relative probabilities.
    expected = torch.zeros(4)
    expected[allowed] = CRAFTED_PROBS[allowed] / CRAFTED_PROBS[allowed].sum()
    assert torch.allclose(frequencies(token_ids, 4), expected, atol=0.02)


def test_top_k_rows_beside_rows_without_top_k():
    logits = CRAFTED_LOGITS.expand(8000, -1).contiguous()
    params = [SamplingParams(top_k=2), SamplingParams()] * 4000
    torch.manual_seed(0)
    token_ids = sample(logits, params).sampled_token_ids
    assert set(token_ids[0::2].tolist()) == {0, 1}
    assert set(token_ids[1::2].tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize("top_k, allowed", [(3, [0, 1, 2, 3, 4, 5]), (2, [0, 1]), (6, [0, 1, 2, 3, 4, 5])])
def test_top_k_keeps_every_token_tied_with_the_kth(top_k, allowed):
    """Ties with the k-th logit running past the k + 1 candidates (k 3) are kept
    as ``apply_top_k`` keeps them; with no tie at the edge (k 2, 6) the draw is
    among the candidates alone."""
    logits = torch.tensor([3.0, 2.0, 1.0, 1.0, 1.0, 1.0, 0.0, -1.0])
    token_ids = draw_many(logits, SamplingParams(temperature=1.0, top_k=top_k), 20000)
    assert set(token_ids.tolist()) == set(allowed)
    probs = logits[allowed].softmax(dim=-1)
    assert torch.allclose(frequencies(token_ids, 8)[allowed], probs, atol=0.015)


def test_top_k_at_or_above_vocab_size_is_off():
    metadata = build([SamplingParams(top_k=4), SamplingParams(top_k=100)], 4)
    assert metadata.no_top_k


def test_frequencies_approach_softmax_of_tempered_logits():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    temperature = 0.7
    token_ids = draw_many(logits, SamplingParams(temperature=temperature), 40000)
    expected = torch.softmax(logits / temperature, dim=-1)
    assert torch.allclose(frequencies(token_ids, 6), expected, atol=0.01)


# ------------------------------------------------------------------ seeds


def run_steps(rows: list[tuple[torch.Tensor, SamplingParams]], num_steps: int) -> list[list[int]]:
    """Tokens of every row over several steps, each seeded row with its own generator."""
    generators = [make_generator(p.seed) if p.seed is not None else None for _, p in rows]
    logits = torch.stack([row_logits for row_logits, _ in rows])
    params = [p for _, p in rows]
    steps = []
    for _ in range(num_steps):
        metadata = build(params, logits.shape[-1], generators=generators)
        steps.append(Sampler().sample(logits, metadata).sampled_token_ids.tolist())
    return [list(column) for column in zip(*steps)]


def test_seeded_rows_are_batch_invariant():
    g = make_generator(4)
    logits_a, logits_b, *others = torch.randn(6, 500, generator=g)
    row_a = (logits_a, SamplingParams(temperature=1.0, top_k=200, seed=11))
    row_b = (logits_b, SamplingParams(temperature=0.8, seed=22))
    alone_a = run_steps([row_a], 10)[0]
    alone_b = run_steps([row_b], 10)[0]

    # Extended with unseeded, greedy and top-p rows (the top-p row draws among
    # its nucleus, the others on their whole vocabulary), and the seeded rows moved.
    extra = [
        (others[0], SamplingParams(temperature=1.0)),
        (others[1], SamplingParams(temperature=0.0, seed=11)),
        (others[2], SamplingParams(top_p=0.5, min_p=0.01)),
        (others[3], SamplingParams(top_k=3, seed=33)),
    ]
    batch = [extra[0], row_b, extra[1], extra[2], row_a, extra[3]]
    tokens = run_steps(batch, 10)
    assert tokens[4] == alone_a
    assert tokens[1] == alone_b
    assert run_steps(list(reversed(batch)), 10)[1] == alone_a


def test_a_seeded_top_p_row_draws_the_same_beside_rows_whose_nucleus_is_long():
    """Flat rows make their nucleus search take more candidates; a peaked seeded row
    draws the same tokens alone, beside them, and anywhere in the batch."""
    g = make_generator(9)
    peaked = torch.randn(4096, generator=g) * 5
    row = (peaked, SamplingParams(temperature=1.0, top_p=0.9, seed=5))
    alone = run_steps([row], 12)[0]
    flat = [(torch.randn(4096, generator=g) * 0.05, SamplingParams(top_p=0.95)) for _ in range(2)]
    plain = (torch.randn(4096, generator=g), SamplingParams(temperature=1.0, seed=6))
    assert run_steps([flat[0], row, plain, flat[1]], 12)[1] == alone
    assert run_steps([plain, flat[0], flat[1], row], 12)[3] == alone
    nucleus = nucleus_by_sorting(peaked, 0.9)
    assert set(alone) <= nucleus and len(set(alone)) > 1


def test_top_p_draws_follow_the_nucleus_renormalised_past_its_first_candidates():
    """A Zipf row whose nucleus (p 0.7) is past the first candidates: the draws keep
    to it, in proportion to the probabilities."""
    ranks = torch.arange(1, 2049, dtype=torch.float32)
    logits = -1.2 * ranks.log()  # token t has rank t + 1
    token_ids = draw_many(logits, SamplingParams(temperature=1.0, top_p=0.7), 20000)
    nucleus = sorted(nucleus_by_sorting(logits, 0.7))
    assert len(nucleus) > 32 and set(token_ids.tolist()) <= set(nucleus)
    probs = logits.softmax(dim=-1)
    expected = probs[nucleus] / probs[nucleus].sum()
    assert torch.allclose(frequencies(token_ids, 2048)[nucleus], expected, atol=0.01)


def test_same_seed_repeats_and_different_seeds_differ():
    logits = torch.zeros(1000)  # uniform: two seeds agreeing 10 times is ~1e-30
    same_a = run_steps([(logits, SamplingParams(seed=1)), (logits, SamplingParams(seed=1))], 10)
    assert same_a[0] == same_a[1]
    assert run_steps([(logits, SamplingParams(seed=2))], 10)[0] != same_a[0]


def test_greedy_row_does_not_consume_its_generator():
    generator = make_generator(9)
    state = generator.get_state()
    logits = torch.randn(2, 20, generator=make_generator(5))
    params = [SamplingParams(temperature=0.0, seed=9), SamplingParams()]
    sample(logits, params, generators=[generator, None])
    assert torch.equal(generator.get_state(), state)


# ------------------------------------------------------------------ penalties


def test_penalties_change_logits_exactly_as_defined():
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.5, -0.5, 1.0, 3.0],
            [2.0, -1.0, 0.5, -0.5, 1.0, 3.0],
        ]
    )
    params = [
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),  # no penalty: unchanged whatever its tokens
    ]
    metadata = build(params, 6, prompts=[[0, 1], [0, 5]], outputs=[[2, 2, 3], [5, 5]])
    penalised = apply_penalties(logits, metadata)
    # Prompt tokens 0, 1 get only the repetition penalty (2 / 2, -1 * 2);
    # output token 2 (twice): 0.5 / 2 - 2 * 0.25 - 0.5; token 3 (once):
    # -0.5 * 2 - 0.25 - 0.5; unseen tokens 4, 5 keep their logits.
    expected = torch.tensor([1.0, -2.0, -0.75, -1.75, 1.0, 3.0])
    assert torch.allclose(penalised[0], expected)
    assert torch.equal(penalised[1], logits[1])


def test_repetition_below_one_favours_seen_tokens():
    logits = torch.tensor([[2.0, -1.0, 0.0]])
    metadata = build([SamplingParams(repetition_penalty=0.5)], 3, prompts=[[0, 1, 2]])
    assert torch.allclose(apply_penalties(logits, metadata), torch.tensor([[4.0, -0.5, 0.0]]))


def test_only_penalised_rows_get_token_statistics():
    params = [SamplingParams(), SamplingParams(frequency_penalty=1.0)]
    metadata = build(params, 5, prompts=[[1], [2]], outputs=[[3, 3], [4, 4, 0]])
    assert metadata.output_token_counts.tolist() == [[0, 0, 0, 0, 0], [1, 0, 0, 0, 2]]
    # No row has a repetition penalty, so no prompt is read.
    assert not metadata.prompt_token_mask.any()


def test_frequency_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[1.0, 0.9, 0.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.1)]
    assert sample(logits, params, outputs=[[0, 0]]).sampled_token_ids.tolist() == [1]


# ------------------------------------------------------------------ logprobs


def expected_ranks(logprobs: torch.Tensor, token_ids: torch.Tensor) -> list[int]:
    ranks = []
    for row, token in zip(logprobs, token_ids.tolist()):
        order = row.argsort(descending=True).tolist()
        ranks.append(order.index(token) + 1)
    return ranks


def test_logprobs_come_from_raw_logits_with_sampled_token_first():
    logits = torch.randn(4, 32, generator=make_generator(6))
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=2.0, logprobs=1, repetition_penalty=1.5, seed=1),
        SamplingParams(temperature=0.5, top_k=5, frequency_penalty=1.0, seed=2),
        SamplingParams(temperature=3.0, logprobs=0, seed=3),
    ]
    out = sample(
        logits,
        params,
        prompts=[[0], [1, 2], [3], [4]],
        outputs=[[5], [6, 6], [7], [8]],
        generators=[None] + [make_generator(s) for s in (1, 2, 3)],
    )
    raw = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert out.logprobs_token_ids.shape == (4, 4) and out.logprobs.shape == (4, 4)
    assert out.logprobs.dtype == torch.float32 and out.logprobs_token_ids.dtype == torch.int64
    assert torch.equal(out.logprobs_token_ids[:, 0], sampled)
    assert torch.allclose(out.logprobs[:, 0], raw.gather(1, sampled.unsqueeze(1)).squeeze(1))
    top_logprobs, top_ids = raw.topk(3, dim=-1)
    assert torch.equal(out.logprobs_token_ids[:, 1:], top_ids)
    assert torch.allclose(out.logprobs[:, 1:], top_logprobs)
    assert out.sampled_token_ranks.tolist() == expected_ranks(raw, sampled)
    assert out.sampled_token_ranks[0] == 1  # the greedy row


def test_logprobs_zero_gives_only_the_sampled_token():
    logits = torch.randn(2, 10, generator=make_generator(7))
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=0)] * 2)
    assert out.logprobs.shape == (2, 1)
    assert torch.allclose(out.logprobs[:, 0], torch.log_softmax(logits, -1).max(dim=-1).values)


def test_rank_of_an_unlikely_sampled_token():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    params = [SamplingParams(temperature=0.0, logprobs=2, frequency_penalty=2.0)]
    # Penalties push the choice to token 2, whose raw rank is 3.
    out = sample(logits, params, outputs=[[0, 0, 1]])  # 3 - 4, 2 - 2, 1
    assert out.sampled_token_ids.tolist() == [2]
    assert out.sampled_token_ranks.tolist() == [3]
    assert out.logprobs_token_ids.tolist() == [[2, 0, 1]]


def test_prompt_logprobs():
    logits = torch.randn(5, 12, generator=make_generator(8))
    target_ids = torch.tensor([3, 0, 11, 7, 7])
    token_ids, logprobs, ranks = compute_prompt_logprobs(logits, target_ids, 2)
    raw = torch.log_softmax(logits, dim=-1)
    assert token_ids.shape == (5, 3) and logprobs.shape == (5, 3) and ranks.shape == (5,)
    assert torch.equal(token_ids[:, 0], target_ids)
    assert torch.allclose(logprobs[:, 0], raw[torch.arange(5), target_ids])
    assert torch.equal(token_ids[:, 1:], raw.topk(2, dim=-1).indices)
    assert torch.allclose(logprobs[:, 1:], raw.topk(2, dim=-1).values)
    assert ranks.tolist() == expected_ranks(raw, target_ids)


# ------------------------------------------------------------------ mixed batches


def test_mixed_batch_of_greedy_and_random_rows():
    num_rows = 2000
    logits = torch.randn(num_rows, 8, generator=make_generator(10)) * 0.1  # nearly uniform
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * (num_rows // 2)
    metadata = build(params, 8)
    assert not metadata.all_greedy and not metadata.all_random
    torch.manual_seed(0)
    token_ids = Sampler().sample(logits, metadata).sampled_token_ids
    argmax = logits.argmax(dim=-1)
    assert torch.equal(token_ids[0::2], argmax[0::2])
    # Random rows over a near-uniform vocabulary pick the argmax ~1/8 of the time.
    agree = (token_ids[1::2] == argmax[1::2]).float().mean().item()
    assert 0.05 < agree < 0.25


def test_sampler_does_not_modify_its_input():
    logits = torch.randn(3, 16, generator=make_generator(11))
    before = logits.clone()
    params = [
        SamplingParams(top_p=0.5, repetition_penalty=1.3, presence_penalty=1.0, logprobs=2)
    ] * 3
    sample(logits, params, prompts=[[1, 2]] * 3, outputs=[[3, 4]] * 3)
    assert torch.equal(logits, before)


# ------------------------------------------------------------------ top-p without a sort


def nucleus_by_sorting(logits: torch.Tensor, top_p: float) -> set[int]:
    """The top-p set by its definition: sort, keep while the mass before a token is below p
    (and the tokens tied with the last one kept)."""
    probs = logits.double().softmax(dim=-1)
    order = probs.argsort(descending=True)
    kept, before = [], 0.0
    for token in order.tolist():
        if before >= top_p:
            break
        kept.append(token)
        before += probs[token].item()
    last = logits[kept[-1]]
    return {t for t in range(len(logits)) if logits[t] >= last and logits[t] > float("-inf")}


@pytest.mark.parametrize("temperature", [0.3, 1.0, 30.0])  # 30: nearly flat, past the candidates
def test_top_p_keeps_the_nucleus_a_sort_finds(temperature):
    from cadence.runner.sampler import NUCLEUS_CANDIDATES, apply_top_p

    vocab_size = 12 * NUCLEUS_CANDIDATES
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(5, vocab_size, generator=generator) * 4 / temperature
    logits[3, 100:] = float("-inf")  # a row min-p or top-k cut short
    top_p = torch.tensor([0.9, 0.5, 0.999, 0.95, 1.0])
    probs = logits.softmax(dim=-1)
    apply_top_p(probs, top_p)
    kept = probs > 0
    for row in range(4):
        expected = nucleus_by_sorting(logits[row], top_p[row].item())
        assert set(kept[row].nonzero().flatten().tolist()) == expected, row
    assert torch.equal(probs[4], logits[4].softmax(dim=-1))  # no top-p: untouched
    if temperature == 30.0:
        assert kept[2].sum() > NUCLEUS_CANDIDATES  # the candidates grew


def test_top_p_grows_its_candidates_in_steps_on_a_long_tail():
    """A Zipf law over 16,384 tokens: a nucleus past 256 and 2,048 candidates, found in steps."""
    from cadence.runner.sampler import apply_top_p

    ranks = torch.arange(1, 16385, dtype=torch.float32)
    logits = (-ranks.log())[torch.randperm(16384, generator=torch.Generator().manual_seed(5))]
    for top_p in (0.7, 0.9):
        probs = logits.softmax(dim=-1).unsqueeze(0)
        apply_top_p(probs, torch.tensor([top_p]))
        kept = probs[0] > 0
        assert set(kept.nonzero().flatten().tolist()) == nucleus_by_sorting(logits, top_p)
        assert kept.sum() > 256


def test_top_p_of_a_row_does_not_depend_on_the_rows_beside_it():
    """A flat row makes the candidates grow for the whole batch; a peaked row keeps its nucleus."""
    from cadence.runner.sampler import apply_top_p

    generator = torch.Generator().manual_seed(4)
    peaked = torch.randn(1, 4096, generator=generator) * 6
    flat = torch.randn(1, 4096, generator=generator) * 0.01
    alone, together = peaked.softmax(dim=-1), torch.cat([flat, peaked]).softmax(dim=-1)
    assert torch.equal(together[1], alone[0])
    apply_top_p(alone, torch.tensor([0.9]))
    apply_top_p(together, torch.tensor([0.99, 0.9]))
    assert torch.equal(together[1], alone[0])


@pytest.mark.parametrize("params", [SamplingParams(top_p=1e-183), SamplingParams(top_p=1e-183, top_k=3),
                                    SamplingParams(top_p=1e-40, seed=3)])
def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token(params):
    """p > 0 passes the params' check but rounds to 0 (or a subnormal) in float32:
    the nucleus is the most likely token, never an empty set (a request with
    top_p 1.9e-183 once stopped the engine: index -1 out of bounds)."""
    token_ids = draw_many(CRAFTED_LOGITS, params, 50)
    assert token_ids.tolist() == [0] * 50


def test_top_p_ties_at_the_edge_are_all_kept():
    from cadence.runner.sampler import apply_top_p

    probs = torch.tensor([[2.0, 1.0, 1.0, 1.0, -1.0]]).softmax(dim=-1)
    apply_top_p(probs, torch.tensor([0.5]))
    assert (probs > 0).tolist() == [[True, True, True, True, False]]


# ------------------------------------------------------------------ properties


@st.composite
def batches(draw):
    vocab_size = draw(st.integers(1, 40))
    num_rows = draw(st.integers(1, 6))
    rows = []
    for _ in range(num_rows):
        values = draw(st.lists(st.floats(-20, 20), min_size=vocab_size, max_size=vocab_size))
        masked = draw(st.lists(st.booleans(), min_size=vocab_size, max_size=vocab_size))
        masked[draw(st.integers(0, vocab_size - 1))] = False  # keep one token
        params = SamplingParams(
            temperature=draw(st.sampled_from([0.0, 1e-6, 0.01, 0.5, 1.0, 5.0])),
            top_k=draw(st.integers(0, vocab_size + 2)),
            top_p=draw(st.floats(0.01, 1.0)),
            min_p=draw(st.floats(0.0, 1.0)),
            seed=draw(st.none() | st.integers(0, 2**31)),
            repetition_penalty=draw(st.sampled_from([1.0, 0.5, 1.3])),
            presence_penalty=draw(st.floats(-2.0, 2.0)),
            frequency_penalty=draw(st.floats(-2.0, 2.0)),
            logprobs=draw(st.none() | st.integers(0, 5)),
        )
        output = draw(st.lists(st.integers(0, vocab_size - 1), max_size=5))
        rows.append((values, masked, params, output))
    return vocab_size, rows


@settings(max_examples=300, deadline=None)
@given(batches())
def test_sampled_ids_are_in_range_and_never_masked(batch):
    vocab_size, rows = batch
    logits = torch.tensor([values for values, _, _, _ in rows])
    masked = torch.tensor([mask for _, mask, _, _ in rows])
    logits = logits.masked_fill(masked, float("-inf"))
    params = [p for _, _, p, _ in rows]
    out = sample(
        logits,
        params,
        prompts=[output[:2] for _, _, _, output in rows],
        outputs=[output for _, _, _, output in rows],
        generators=[make_generator(p.seed) if p.seed is not None else None for p in params],
    )
    token_ids = out.sampled_token_ids
    assert ((token_ids >= 0) & (token_ids < vocab_size)).all()
    assert not masked.gather(1, token_ids.unsqueeze(1)).any()


def test_a_draw_on_the_cdf_skips_zero_probabilities_and_never_runs_past_the_end():
    from cadence.runner.sampler import place_on_cdf

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0]] * 5)
    uniform = torch.tensor([[0.0], [0.49], [0.5], [0.999], [1.0]])  # 1.0: a draw rounded up to the total
    assert place_on_cdf(probs, uniform).tolist() == [1, 1, 3, 3, 3]


def test_a_given_argmax_picks_the_greedy_rows_of_a_mixed_batch():
    """Sampler(argmax=...) takes every greedy row's token from that function, and the
    random rows' draws are the same as without it (the C kernel's, FusedOps.argmax)."""
    calls = []

    def counting_argmax(logits):
        calls.append(tuple(logits.shape))
        return logits.argmax(dim=-1)

    logits = torch.randn(4, 1000, generator=make_generator(3))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=9)] * 2

    def draw(sampler):
        metadata = build(params, 1000, generators=[None, make_generator(9), None, make_generator(9)])
        return sampler.sample(logits, metadata).sampled_token_ids

    assert torch.equal(draw(Sampler(argmax=counting_argmax)), draw(Sampler()))
    assert calls == [(4, 1000)]
    greedy = build([SamplingParams(temperature=0.0)] * 4, 1000)
    assert torch.equal(Sampler(argmax=counting_argmax).sample(logits, greedy).sampled_token_ids,
                       logits.argmax(dim=-1))
    assert calls == [(4, 1000)] * 2
