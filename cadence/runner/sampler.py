"""Turn one step's logits into next tokens (and the logprobs clients asked for).

Data flow of ``Sampler.sample`` for B rows over a vocabulary of V tokens::

    raw logits (B, V) ──► log_softmax ──► logprobs of the sampled token + top-k
         │                                (only when some row asks for logprobs)
         ▼
    penalties: repetition (prompt ∪ output tokens), then frequency and presence
         │     (output tokens only)
         ├──► greedy rows: argmax
         ▼
    random rows: ÷ temperature ─► min_p ─► top_k ─► softmax ─► top_p
                 ─► a draw: one uniform on the cumulative sum of what the row
                    keeps (CPU: a top-k row's k candidates, a top-p row's
                    nucleus, found by a ``topk``, never sorting V), or
                    argmax(p / q) with q ~ Exp(1) (GPU, the filtered tokens
                    masked or zeroed first)

Logprobs come from the raw logits, before penalties, temperature and the
filters: they report what the model believes, the number clients compare
across requests, and they stay finite for every token, where the filtered
distribution is -inf almost everywhere. (vLLM's default does the same.)

Either draw picks token t with probability p_t, also where top-p left a row
summing to less than 1 (both scale by the row's sum). A row whose request
has a seed draws from its own generator (``draw_uniforms``,
``exponential_sample``), so its tokens depend only on its logits and its
generator, never on which other rows share the batch or where the row sits
in it. Unseeded rows share one draw from torch's default generator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cadence.runner.sampling_metadata import SamplingMetadata
from cadence.sampling_params import GREEDY_EPSILON

_NEG_INF = float("-inf")
# Most likely tokens of a row among which top-p first looks for its nucleus
# (``apply_top_p``): SmolLM2's decodes at temperature 0.8 and p 0.9 kept 2
# tokens at the median, 16 at the 90th percentile.
NUCLEUS_CANDIDATES = 32


@dataclass(frozen=True)
class SamplerOutput:
    """Tokens of one step, and their logprobs when some row asked for them.

    The logprobs tensors have ``1 + metadata.max_num_logprobs`` columns for
    every row; a row that asked for k logprobs keeps the first ``1 + k``.
    """

    sampled_token_ids: torch.Tensor  # (B,) int64
    logprobs_token_ids: torch.Tensor | None = None  # (B, 1 + k) int64: sampled, then top-k
    logprobs: torch.Tensor | None = None  # (B, 1 + k) float32, same layout
    sampled_token_ranks: torch.Tensor | None = None  # (B,) int64, 1 = most likely


class Sampler:
    """Stateless; holds no tensors, so one instance serves every step.

    ``argmax``: each row's argmax of float32 logits [B, V], as ``torch.argmax``
    gives it (the CPU runner passes the C kernel's, ``FusedOps.argmax``: PyTorch
    took 0.4 ms for one row of a 262,144-token vocabulary); default PyTorch's.
    """

    def __init__(self, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.argmax = argmax if argmax is not None else _torch_argmax

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Pick one token per row of ``logits`` (B, V); ``logits`` is not modified."""
        logits = logits.float()
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)  # (B, V)
        logits = apply_penalties(logits, metadata)
        token_ids = _pick_tokens(logits, metadata, self.argmax)  # (B,)
        if raw_logprobs is None:
            return SamplerOutput(sampled_token_ids=token_ids)
        ids, logprobs, ranks = gather_logprobs(raw_logprobs, token_ids, metadata.max_num_logprobs)
        return SamplerOutput(token_ids, ids, logprobs, ranks)


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def _pick_tokens(logits: torch.Tensor, metadata: SamplingMetadata,
                 argmax: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """(B,) int64: argmax for greedy rows, a filtered random draw for the others."""
    if metadata.all_greedy:
        return argmax(logits)
    random_ids = _sample_random(logits, metadata)
    if metadata.all_random:
        return random_ids
    is_greedy = metadata.temperature < GREEDY_EPSILON  # (B,)
    return torch.where(is_greedy, argmax(logits), random_ids)


def _sample_random(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """(B,) int64 drawn after temperature and filters (greedy rows are filtered as off)."""
    logits = apply_temperature(logits, metadata.temperature)
    if metadata.min_p is not None:
        logits = apply_min_p(logits, metadata.min_p)
    if logits.device.type == "cpu":
        return _draw_on_cpu(logits, metadata)
    if metadata.top_k is not None:
        logits = apply_top_k(logits, metadata.top_k, metadata.max_top_k)
    probs = logits.softmax(dim=-1)  # (B, V)
    if metadata.top_p is not None:
        apply_top_p(probs, metadata.top_p)  # (the race scales by each row's sum)
    return exponential_sample(probs, metadata.generators)


def _draw_on_cpu(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """(B,) int64: one uniform a row (``draw_uniforms``), placed on the cumulative sum
    of what the row keeps. Rows with top-k draw among their k candidates
    (``top_k_sample``), rows with top-p alone among their nucleus
    (``nucleus_sample``), the others on the whole vocabulary."""
    uniform = draw_uniforms(len(logits), metadata.generators)  # (B, 1)
    if metadata.top_k is None and metadata.top_p is None:
        return place_on_cdf(logits.softmax(dim=-1), uniform)
    vocab_size = logits.shape[-1]
    top_p = metadata.top_p if metadata.top_p is not None else torch.ones(len(logits))
    token_ids = torch.empty(len(logits), dtype=torch.int64)
    rest = torch.ones(len(logits), dtype=torch.bool)  # rows not drawn yet
    if metadata.top_k is not None:
        rows = (metadata.top_k < vocab_size).nonzero().flatten()
        drawn, done = top_k_sample(_rows(logits, rows), metadata.top_k[rows], metadata.max_top_k,
                                   top_p[rows], uniform[rows])
        token_ids[rows[done]] = drawn[done]
        rest[rows[done]] = False
    rows = rest.nonzero().flatten()
    if len(rows):
        row_logits = _rows(logits, rows)
        if metadata.top_k is not None:  # rows whose k-th logit ties past the candidates
            row_logits = apply_top_k(row_logits, metadata.top_k[rows], metadata.max_top_k)
        token_ids[rows] = nucleus_sample(row_logits.softmax(dim=-1), top_p[rows], uniform[rows])
    return token_ids


def _rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """t[rows] for sorted unique ``rows``, without a copy when they are all of t's."""
    return t if len(rows) == len(t) else t[rows]


def top_k_sample(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int, top_p: torch.Tensor,
                 uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with top-k (R, V logits; ``top_k`` (R,) below V) drawn among their k most
    likely tokens and the tokens tied with the k-th, renormalised, then among
    top-p's nucleus of those (``top_p`` 1: off), by ``uniform`` (R, 1). One
    ``topk`` reads the vocabulary, one token wider than ``max_top_k`` to see
    whether a tie goes on past it; nothing else does. Returns the tokens (R,)
    and where they hold (R,): a row whose k-th logit is tied past the candidates
    is left to the caller."""
    width = min(max_top_k + 1, logits.shape[-1])
    values, ids = logits.topk(width, dim=-1)  # (R, width), descending
    kth_value = values.gather(1, (top_k - 1).unsqueeze(1))  # (R, 1)
    done = values[:, -1] < kth_value[:, 0]
    if width == logits.shape[-1]:
        done = torch.ones_like(done)
    probs = values.masked_fill(values < kth_value, _NEG_INF).softmax(dim=-1)  # (R, width), descending
    filtered = top_p < 1.0
    if bool(filtered.any()):
        threshold, _, _ = _nucleus(probs, top_p, whole_vocabulary=True)  # (every kept token is here)
        probs.masked_fill_(probs < threshold.masked_fill(~filtered.unsqueeze(1), 0.0), 0.0)
    places = place_on_cdf(probs, uniform)  # (R,)
    return ids.gather(1, places.unsqueeze(1)).squeeze(1), done


# ---------------------------------------------------------------- penalties


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition, then frequency and presence penalties; a new (B, V) tensor."""
    if metadata.no_penalties:
        return logits
    seen = metadata.prompt_token_mask | (metadata.output_token_counts > 0)  # (B, V)
    logits = apply_repetition_penalty(logits, seen, metadata.repetition_penalties)
    return apply_frequency_presence_penalties(
        logits,
        metadata.output_token_counts,
        metadata.frequency_penalties,
        metadata.presence_penalties,
    )


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalties: torch.Tensor
) -> torch.Tensor:
    """Make seen tokens less likely: divide positive logits by r, multiply negative ones.

    logits (B, V), seen (B, V) bool, penalties (B,); r > 1 penalises, r < 1 favours.
    """
    r = penalties.unsqueeze(1)  # (B, 1)
    penalised = torch.where(logits > 0, logits / r, logits * r)  # (B, V)
    return torch.where(seen, penalised, logits)


def apply_frequency_presence_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """OpenAI semantics: ``logit - frequency * count - presence * (count > 0)``.

    logits (B, V), output_counts (B, V) int, frequency and presence (B,).
    """
    counts = output_counts.to(logits.dtype)  # (B, V)
    occurred = (output_counts > 0).to(logits.dtype)  # (B, V)
    return logits - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * occurred


# ---------------------------------------------------- temperature and filters


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature (B,); greedy rows are divided by 1."""
    safe = torch.where(temperature < GREEDY_EPSILON, torch.ones_like(temperature), temperature)
    return logits / safe.unsqueeze(1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's top probability."""
    probs = logits.softmax(dim=-1)  # (B, V)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # (B, 1)
    return logits.masked_fill(probs < threshold, _NEG_INF)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (ties with the k-th kept), without a sort.

    top_k (B,) is V for rows without top-k; ``max_top_k`` is the largest
    value below V, so one ``topk`` of width max_top_k serves every row.
    """
    vocab_size = logits.shape[-1]
    top_values = logits.topk(max_top_k, dim=-1).values  # (B, K), descending
    kth_index = (top_k.clamp(max=max_top_k) - 1).unsqueeze(1)  # (B, 1)
    kth_value = top_values.gather(1, kth_index)  # (B, 1)
    kth_value = kth_value.masked_fill(top_k.unsqueeze(1) >= vocab_size, _NEG_INF)
    return logits.masked_fill(logits < kth_value, _NEG_INF)


def apply_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> None:
    """Zero, in place, the probabilities outside each row's nucleus: the smallest set of
    most likely tokens whose probability reaches ``top_p`` (and every token tied
    with the last of them), found without sorting the vocabulary.

    probs (B, V) sum to 1 a row; top_p (B,) is 1 for rows without top-p. A token
    is kept when the tokens more likely than it hold less than p::

        most likely first:   0.5   0.3   0.15  0.05      p = 0.7
        mass before it:      0     0.5   0.8   0.95
        kept:                yes   yes   no    no

    The nucleus is looked for among the ``NUCLEUS_CANDIDATES`` most likely
    tokens of each row (a ``topk``), more while some row's candidates hold
    less than its p (``_more_candidates``; only those rows look again), the
    whole vocabulary at last. A row's result depends on neither the number of
    candidates nor the other rows; rows without top-p cost nothing. The kept
    probabilities are left as they are: the draws scale by a row's sum. (A
    sort of the vocabulary took 34 ms a row for Gemma 3's 262,144 tokens on a
    2-core EPYC, more than a decode step; BENCHMARKS.md, top-p-v1.)
    """
    threshold = torch.zeros(len(probs), 1, dtype=probs.dtype, device=probs.device)  # 0: keep all
    for rows, _, _, row_threshold in _nucleus_rounds(probs, top_p, (top_p < 1.0).nonzero().flatten()):
        threshold[rows] = row_threshold
    probs.masked_fill_(probs < threshold, 0.0)


def _nucleus_rounds(probs: torch.Tensor, top_p: torch.Tensor, rows: torch.Tensor):
    """The search of ``apply_top_p`` and ``nucleus_sample`` for ``rows`` (sorted, unique)
    of ``probs``: round by round, the rows whose nucleus was found, with their
    candidates (F, count, descending), the candidates' token ids and the last
    kept token's probability (F, 1). Each round takes ``_more_candidates`` for
    the rows still short, the whole vocabulary at last."""
    vocab_size = probs.shape[-1]
    count = min(NUCLEUS_CANDIDATES, vocab_size)
    while len(rows):
        candidates, ids = _rows(probs, rows).topk(count, dim=-1)  # (R, count)
        threshold, found, shortfall = _nucleus(candidates, top_p[rows], count == vocab_size)
        yield rows[found], candidates[found], ids[found], threshold[found]
        if bool(found.all()):
            return
        count = _more_candidates(count, vocab_size, shortfall[~found].max().item())
        rows = rows[~found]


def _nucleus(candidates: torch.Tensor, top_p: torch.Tensor,
             whole_vocabulary: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From each row's most likely probabilities (R, count, descending): the last kept
    token's probability (R, 1), meaningful where the nucleus is among them
    (``found``, R: they hold p, and no token tied with the last kept one lies
    past them), and each row's shortfall (R): p over the mass they hold."""
    mass = candidates.cumsum(dim=-1)
    mass_before = torch.cat([torch.zeros_like(mass[:, :1]), mass[:, :-1]], dim=1)
    # The most likely token is always kept, also where p rounds to 0 in float32 (1e-183 passes
    # the params' p > 0 and becomes 0 here: no mass would be below it).
    num_kept = (mass_before < top_p.unsqueeze(1)).sum(dim=1, keepdim=True).clamp_(min=1)
    threshold = candidates.gather(1, num_kept - 1)
    found = (mass[:, -1] >= top_p) & (candidates[:, -1] < threshold[:, 0])
    if whole_vocabulary:
        found = torch.ones_like(found)
    return threshold, found, top_p / mass[:, -1]


def nucleus_sample(probs: torch.Tensor, top_p: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """(B,) int64 on the CPU: each row with top-p (top_p < 1) draws among its nucleus,
    found as ``apply_top_p`` finds it, by placing its ``uniform`` (B, 1) on the
    nucleus' cumulative sum, most likely token first; the other rows on their
    whole cumulative sum (``place_on_cdf``). Past the ``topk`` that finds a
    nucleus nothing reads the vocabulary again (no zeroing, no cumulative sum
    over V)."""
    token_ids = torch.empty(len(probs), dtype=torch.int64)
    whole = top_p >= 1.0  # (B,)
    if bool(whole.any()):
        token_ids[whole] = place_on_cdf(probs[whole], uniform[whole])
    for rows, candidates, ids, threshold in _nucleus_rounds(probs, top_p, (~whole).nonzero().flatten()):
        kept = candidates.masked_fill(candidates < threshold, 0.0)
        places = place_on_cdf(kept, uniform[rows])  # (F,): places among the candidates
        token_ids[rows] = ids.gather(1, places.unsqueeze(1)).squeeze(1)
    return token_ids


def _more_candidates(count: int, vocab_size: int, shortfall: float) -> int:
    """The next number of top-p candidates after ``count`` held 1/``shortfall`` of some
    row's p: eight times as many, or more where that row's tail looks as flat as its
    head, and the whole vocabulary once that is a good part of it (a flat row's
    nucleus is most of the vocabulary: growing step by step would take a ``topk``
    of it several times)."""
    wanted = max(count * 8, int(count * shortfall * 1.5))
    return vocab_size if wanted * 4 >= vocab_size else wanted


# ---------------------------------------------------------------- drawing


def exponential_sample(
    probs: torch.Tensor, generators: dict[int, torch.Generator]
) -> torch.Tensor:
    """(B,) int64: ``argmax(probs / q)`` with ``q ~ Exp(1)``, i.e. token t with probability p_t.

    Rows in ``generators`` draw their (V,) noise from their own generator.
    """
    q = torch.empty_like(probs)  # (B, V)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    # q == 0 would turn a zero probability into 0/0 = NaN, which argmax picks.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)


def draw_uniforms(num_rows: int, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """(B, 1) float32 in [0, 1): the CPU's draw, one uniform a row, placed on the
    row's cumulative distribution (``place_on_cdf``, ``nucleus_sample``: the
    first token whose cumulative sum passes it). The exponential race draws V
    random numbers a row, 4.9 ms for Gemma 3's 262k-token vocabulary against
    0.2 ms here (BENCHMARKS.md, sampling-v1); a GPU keeps the race (no search,
    no host round trip).

    Rows in ``generators`` draw their uniform from their own generator.
    """
    uniform = torch.empty(num_rows, 1)
    if len(generators) < num_rows:
        uniform.uniform_()
    for row, generator in generators.items():
        uniform[row].uniform_(generator=generator)
    return uniform


def place_on_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """(B,) int64: for each row of ``probs`` (B, V), the first token whose
    cumulative probability passes ``uniform`` (B, 1, in [0, 1)) of the row's total.
    A token of probability 0 is never drawn: its cumulative sum equals the one
    before it, which the search stops at first."""
    vocab_size = probs.shape[-1]
    cumulative = probs.cumsum(dim=-1)  # (B, V)
    # u * total < total for u < 1, but rounding may reach it: that draw takes
    # the row's last token of non-zero probability instead of running past the end.
    ids = torch.searchsorted(cumulative, uniform * cumulative[:, -1:], right=True).squeeze(1)
    past_end = ids >= vocab_size
    if past_end.any():
        last_positive = vocab_size - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
        ids = torch.where(past_end, last_positive, ids)
    return ids


# ---------------------------------------------------------------- logprobs


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chosen token's logprob and rank, and the row's ``num_logprobs`` best tokens.

    logprobs (N, V), token_ids (N,) -> ids (N, 1 + k) int64 and logprobs
    (N, 1 + k) with the chosen token in column 0, and ranks (N,) int64
    (1-based: 1 + the number of tokens strictly more likely). k is
    ``num_logprobs`` capped at V.
    """
    k = min(num_logprobs, logprobs.shape[-1])
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)  # (N, k)
    token_ids = token_ids.unsqueeze(1)  # (N, 1)
    token_logprobs = logprobs.gather(1, token_ids)  # (N, 1)
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1  # (N,)
    ids = torch.cat([token_ids, top_ids], dim=1)
    return ids, torch.cat([token_logprobs, top_logprobs], dim=1), ranks


def compute_prompt_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of each prompt position's actual next token, plus the top ``num_logprobs``.

    logits (P, V) raw model output at P positions, target_ids (P,) the token
    that follows each position -> (ids (P, 1 + k), logprobs (P, 1 + k),
    ranks (P,)), laid out as in ``gather_logprobs``.
    """
    logprobs = logits.float().log_softmax(dim=-1)  # (P, V)
    return gather_logprobs(logprobs, target_ids, num_logprobs)
