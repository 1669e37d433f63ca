"""Sampling parameters of one step's batch, as the tensors the sampler reads.

The runner builds one ``SamplingMetadata`` per step from the ``SamplingParams``
of its B rows (row i of the logits is row i here). Whatever no row needs is
left as ``None`` and the sampler skips that stage, so a batch of greedy rows
without penalties or logprobs costs a couple of passes over the params and
allocates no tensor at all.

Conventions, so that no stage needs a per-row branch:

* greedy rows keep their (tiny) temperature; the sampler detects them with
  ``temperature < GREEDY_EPSILON`` and ignores their filters;
* a row without top-k has ``top_k == V``, without top-p ``top_p == 1``,
  without min-p ``min_p == 0``, without penalties the neutral values
  (repetition 1, presence 0, frequency 0).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from cadence.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded for one request; the runner keeps it for the request's life."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass(frozen=True)
class SamplingMetadata:
    """Batched sampling parameters of B rows over a vocabulary of V tokens."""

    num_rows: int
    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor | None  # (B,) float32; None when every row is greedy
    top_k: torch.Tensor | None  # (B,) int64, V where off; None when no random row sets it
    max_top_k: int  # largest top_k below V among random rows; 0 when top_k is None
    top_p: torch.Tensor | None  # (B,) float32, 1.0 where off
    min_p: torch.Tensor | None  # (B,) float32, 0.0 where off
    # Random rows that carry their own generator, by row index. Greedy rows
    # never draw, so they are left out even when their request has a seed.
    generators: dict[int, torch.Generator]
    max_num_logprobs: int | None  # largest `logprobs` asked by any row; None: no row asks
    repetition_penalties: torch.Tensor | None  # (B,) float32; None when no row has a penalty
    presence_penalties: torch.Tensor | None  # (B,) float32
    frequency_penalties: torch.Tensor | None  # (B,) float32
    # Tokens seen in the prompt, only for rows with a repetition penalty.
    prompt_token_mask: torch.Tensor | None  # (B, V) bool
    # How often each token occurs in the output so far, only for penalised rows.
    output_token_counts: torch.Tensor | None  # (B, V) int32

    @property
    def no_top_k(self) -> bool:
        return self.top_k is None

    @property
    def no_top_p(self) -> bool:
        return self.top_p is None

    @property
    def no_min_p(self) -> bool:
        return self.min_p is None

    @property
    def no_penalties(self) -> bool:
        return self.repetition_penalties is None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device | str,
    ) -> "SamplingMetadata":
        """Batch the per-row parameters; row i of every argument is logits row i.

        ``prompt_token_ids`` and ``output_token_ids`` are read only for rows
        with a penalty; every token id must be below ``vocab_size``.
        """
        is_greedy = [p.is_greedy for p in params]
        all_greedy = all(is_greedy)
        all_random = not any(is_greedy)
        filters = (
            _Filters() if all_greedy else _build_filters(params, is_greedy, vocab_size, device)
        )
        penalties = _build_penalties(
            params, prompt_token_ids, output_token_ids, vocab_size, device
        )
        return cls(
            num_rows=len(params),
            all_greedy=all_greedy,
            all_random=all_random,
            temperature=filters.temperature,
            top_k=filters.top_k,
            max_top_k=filters.max_top_k,
            top_p=filters.top_p,
            min_p=filters.min_p,
            generators={
                row: gen
                for row, gen in enumerate(generators)
                if gen is not None and not is_greedy[row]
            },
            max_num_logprobs=max(
                (p.logprobs for p in params if p.logprobs is not None), default=None
            ),
            repetition_penalties=penalties.repetition,
            presence_penalties=penalties.presence,
            frequency_penalties=penalties.frequency,
            prompt_token_mask=penalties.prompt_token_mask,
            output_token_counts=penalties.output_token_counts,
        )


@dataclass
class _Filters:
    temperature: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    max_top_k: int = 0
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None


def _build_filters(
    params: list[SamplingParams], is_greedy: list[bool], vocab_size: int, device
) -> _Filters:
    """Temperature and the top-k / top-p / min-p tensors that some random row uses."""
    random_params = [p for p, greedy in zip(params, is_greedy) if not greedy]
    filters = _Filters(temperature=_float_tensor([p.temperature for p in params], device))
    # A greedy row's filters would not change its argmax, so they count as off.
    top_ks = [
        vocab_size if greedy or not 0 < p.top_k < vocab_size else p.top_k
        for p, greedy in zip(params, is_greedy)
    ]
    if any(k < vocab_size for k in top_ks):
        filters.top_k = torch.tensor(top_ks, dtype=torch.int64, device=device)
        filters.max_top_k = max(k for k in top_ks if k < vocab_size)
    if any(p.top_p < 1.0 for p in random_params):
        filters.top_p = _float_tensor(
            [1.0 if greedy else p.top_p for p, greedy in zip(params, is_greedy)], device
        )
    if any(p.min_p > 0.0 for p in random_params):
        filters.min_p = _float_tensor(
            [0.0 if greedy else p.min_p for p, greedy in zip(params, is_greedy)], device
        )
    return filters


@dataclass
class _Penalties:
    repetition: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    prompt_token_mask: torch.Tensor | None = None
    output_token_counts: torch.Tensor | None = None


def _has_penalty(p: SamplingParams) -> bool:
    return (
        p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
    )


def _build_penalties(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    vocab_size: int,
    device,
) -> _Penalties:
    """Penalty values and token statistics, built only when some row has a penalty."""
    penalised_rows = [row for row, p in enumerate(params) if _has_penalty(p)]
    if not penalised_rows:
        return _Penalties()
    # Only the repetition penalty reads the prompt, and prompts can be long.
    repetition_rows = [row for row in penalised_rows if params[row].repetition_penalty != 1.0]
    num_rows = len(params)
    return _Penalties(
        repetition=_float_tensor([p.repetition_penalty for p in params], device),
        presence=_float_tensor([p.presence_penalty for p in params], device),
        frequency=_float_tensor([p.frequency_penalty for p in params], device),
        prompt_token_mask=_token_mask(
            prompt_token_ids, repetition_rows, num_rows, vocab_size, device
        ),
        output_token_counts=_token_counts(
            output_token_ids, penalised_rows, num_rows, vocab_size, device
        ),
    )


def _token_counts(
    token_ids: list[list[int]], rows: list[int], num_rows: int, vocab_size: int, device
) -> torch.Tensor:
    """(B, V) int32: occurrences of each token in each listed row; other rows stay zero."""
    counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32, device=device)
    flat_index = _flat_token_index(token_ids, rows, vocab_size, device)  # (N,)
    ones = torch.ones(flat_index.numel(), dtype=torch.int32, device=device)
    counts.view(-1).index_add_(0, flat_index, ones)
    return counts


def _token_mask(
    token_ids: list[list[int]], rows: list[int], num_rows: int, vocab_size: int, device
) -> torch.Tensor:
    """(B, V) bool: which tokens occur in each listed row; other rows stay False."""
    mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
    mask.view(-1)[_flat_token_index(token_ids, rows, vocab_size, device)] = True
    return mask


def _flat_token_index(
    token_ids: list[list[int]], rows: list[int], vocab_size: int, device
) -> torch.Tensor:
    """(N,) int64: ``row * V + token`` for every token of the listed rows.

    Indexes a (B, V) tensor viewed flat, so one scatter fills all rows.
    """
    flat_ids = torch.tensor(
        list(itertools.chain.from_iterable(token_ids[row] for row in rows)), dtype=torch.int64
    )  # (N,)
    lengths = torch.tensor([len(token_ids[row]) for row in rows], dtype=torch.int64)
    row_of_id = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)  # (N,)
    return (row_of_id * vocab_size + flat_ids).to(device)


def _float_tensor(values: list[float], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)
