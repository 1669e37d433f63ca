"""What a step's sampled rows become: drafts accepted, logprobs gathered per
request, the grammar mask and min_tokens applied to the logits rows.

The logits of one step come in groups, one per sampling request: 1 + its
number of drafts rows, row j being the target's choice after drafts[:j].
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from cadence.core.outputs import LogprobsLists
from cadence.runner.grammar_mask import apply_grammar_bitmask, grammar_rows

if TYPE_CHECKING:
    from cadence.core.sched.output import SchedulerOutput
    from cadence.runner.input_batch import RequestState
    from cadence.runner.sampler import SamplerOutput


def accept_drafts(drafts: list[int], sampled: list[int]) -> list[int]:
    """The accepted drafts plus the target's own next token.

    ``sampled[j]`` is what the target picked after ``drafts[:j]``
    (len(drafts) + 1 entries). Draft j is accepted while every pick so far
    equals its draft; the first disagreement is replaced by the pick, which is
    an exact sample of the target (and the argmax under greedy), so the output
    distribution is the target's own.
    """
    num_accepted = 0
    while num_accepted < len(drafts) and sampled[num_accepted] == drafts[num_accepted]:
        num_accepted += 1
    return sampled[: num_accepted + 1]


def logprobs_lists(
    output: SamplerOutput,
    seqs: list[int],
    first_rows: list[int],
    states: list[RequestState],
    sampled: list[list[int]],
    num_reqs: int,
) -> LogprobsLists | None:
    """A row per token each request sampled (its accepted drafts and the
    target's own token), for the requests that asked for logprobs; the
    request offsets in ``cu_num_generated_tokens``.

    Accepted token j of a request is the target's pick at its logits row
    first + j (drafts are accepted only where the pick equals them), so its
    row there describes it.
    """
    if output.logprobs is None:
        return None
    counts = [0] * num_reqs
    row_index: list[int] = []  # sampler rows, in request order
    limits: list[int] = []
    for s, first, state in zip(seqs, first_rows, states):
        k = state.sampling_params.logprobs
        if k is None:
            continue
        counts[s] = len(sampled[s])
        row_index.extend(range(first, first + counts[s]))
        limits.extend([1 + k] * counts[s])
    cu = [0, *itertools.accumulate(counts)]
    all_ids, all_logprobs = output.logprobs_token_ids.tolist(), output.logprobs.tolist()
    all_ranks = output.sampled_token_ranks.tolist()
    # ``seqs`` ascend, so request s's rows sit at cu[s]:cu[s + 1].
    token_ids = [all_ids[row][:limit] for row, limit in zip(row_index, limits)]
    logprobs = [all_logprobs[row][:limit] for row, limit in zip(row_index, limits)]
    ranks = [all_ranks[row] for row in row_index]
    return LogprobsLists(token_ids, logprobs, ranks, cu_num_generated_tokens=cu)


def apply_grammar(
    logits: torch.Tensor, scheduler_output: SchedulerOutput, req_ids: list[str], group_sizes: list[int],
) -> tuple[list[int], torch.Tensor | None]:
    """Mask the structured requests' logits rows: (those rows, their allowed tokens)."""
    logits_rows, mask_rows = grammar_rows(req_ids, group_sizes, scheduler_output.structured_output_request_ids)
    allowed = apply_grammar_bitmask(logits, scheduler_output.grammar_bitmask, logits_rows, mask_rows)
    return logits_rows, allowed


def suppress_stops_before_min_tokens(
    logits: torch.Tensor, states: list[RequestState], drafts: list[list[int]]
) -> bool:
    """EOS and stop tokens get -inf while a request has fewer than min_tokens
    outputs; whether any did.

    ``logits`` [N, V] has 1 + len(drafts) rows per sampling request.
    """
    suppressed = False
    row = 0
    for state, seq_drafts in zip(states, drafts):
        num_rows = 1 + len(seq_drafts)
        if state.min_tokens_pending:
            stop_ids = state.stop_ids()
            if stop_ids:
                logits[row:row + num_rows, stop_ids] = float("-inf")
                suppressed = True
        row += num_rows
    return suppressed
