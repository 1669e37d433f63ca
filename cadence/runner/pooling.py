"""Pooled hidden states of embedding requests (``SamplingParams.pooling``).

A pooling request's prompt runs through the model like any other (chunked,
batched beside generation); it samples nothing. In the step that computes
its prompt's last token the runner returns its pooled final hidden state
(the model's final norm applied, as every forward returns it), divided by
its L2 norm unless the request says not to; the scheduler then finishes it.

    last   the state of the last prompt position: only the last chunk's last row
    mean   the mean over every prompt position: each chunk's rows are added to
           the request's sum (``RequestState.pooled_sum``); rows of positions
           already added (a recompute after preemption) are skipped

Mean pooling reads every position, so such a request takes no prefix-cache
hit (``SamplingParams.needs_every_prompt_position``); last-token pooling
takes hits, and the scheduler always leaves the last token to compute.
"""

from __future__ import annotations

import torch

from cadence.runner.input_batch import RequestState, StepInputs


class Pooler:
    """Pools the step's hidden states for its pooling requests."""

    def __init__(self, default_type: str | None) -> None:
        """``default_type``: what a request that names no type pools (the model's)."""
        self.default_type = default_type or "last"

    def pool(self, step: StepInputs, hidden: torch.Tensor,
             states: list[RequestState]) -> list[list[float] | None]:
        """Per request of the step: its pooled state if its prompt ended here, else
        None; [] when the step holds no pooling request. ``hidden``: [T, H]."""
        if not step.pools.any():
            return []
        pooled: list[list[float] | None] = [None] * len(step.req_ids)
        for s in step.pools.nonzero()[0].tolist():
            state = states[step.rows[s]]
            first, end = int(step.query_start_loc[s]), int(step.query_start_loc[s + 1])
            start_position, end_position = int(step.num_computed[s]), int(step.seq_lens[s])
            params = state.sampling_params.pooling
            if (params.type or self.default_type) == "mean":
                self._add_rows(state, hidden[first:end], start_position)
            if end_position < state.num_prompt_tokens:
                continue  # a chunk before the prompt's last
            if (params.type or self.default_type) == "mean":
                vector = state.pooled_sum / state.num_pooled  # [H]
            else:
                vector = hidden[end - 1].float()  # [H]
            if params.normalize:
                vector = torch.nn.functional.normalize(vector, dim=-1)
            pooled[s] = vector.cpu().tolist()
        return pooled

    @staticmethod
    def _add_rows(state: RequestState, rows: torch.Tensor, start_position: int) -> None:
        """Add the rows of positions ``start_position..`` not yet in the request's sum."""
        skip = state.num_pooled - start_position
        if skip >= rows.shape[0]:
            return
        rows = rows[max(0, skip):].float()  # [P, H]
        total = rows.sum(dim=0)
        state.pooled_sum = total if state.pooled_sum is None else state.pooled_sum + total
        state.num_pooled += rows.shape[0]
