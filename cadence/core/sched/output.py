"""The scheduler's decision for one step, as plain data for the runner.

A request's full data (prompt, sampling params, block ids) is sent once, in
``scheduled_new_reqs``, the first time it is scheduled; after that only the
deltas travel in ``scheduled_cached_reqs`` (new block ids, the computed-token
count). The runner keeps per-request state between steps and drops it for the
ids in ``finished_req_ids`` and ``preempted_req_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# At run time, not only for the type checker: the compiled build (core/compiled.py)
# reads the dataclasses' annotations when it creates them.
from cadence.core.kv_cache import BlockIds
from cadence.core.request import LoRARequest, PlaceholderRange, Request
from cadence.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen (or must rebuild from scratch)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: "SamplingParams"
    block_ids: BlockIds
    num_computed_tokens: int
    lora_request: "LoRARequest | None" = None
    # Tokens already sampled (a forked child or a resumed request sent anew).
    output_token_ids: list[int] = field(default_factory=list)
    mm_positions: "list[PlaceholderRange]" = field(default_factory=list)
    mm_hashes: list[str] = field(default_factory=list)
    parent_request_id: str | None = None
    # The runner keeps EOS (and stop tokens) from being sampled before min_tokens.
    eos_token_id: int | None = None

    @classmethod
    def from_request(cls, request: "Request", block_ids: BlockIds) -> "NewRequestData":
        return cls(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            lora_request=request.lora_request,
            output_token_ids=list(request.output_token_ids),
            mm_positions=request.mm_positions,
            mm_hashes=request.mm_hashes,
            parent_request_id=request.parent_request_id,
            eos_token_id=request.eos_token_id if request.stops_on_eos else None,
        )


@dataclass(slots=True)
class CachedRequestData:
    """Deltas for requests the runner already holds, in parallel lists.

    ``num_computed_tokens[i]`` is the count *before* this step's tokens.
    For a request resumed from preemption, ``new_block_ids[i]`` is its whole
    block list (its old blocks were freed), not an addition.
    ``new_token_ids[i]`` is filled only where the runner cannot know the
    tokens itself; normally it keeps the tokens it sampled.
    """

    req_ids: list[str] = field(default_factory=list)
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[BlockIds] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """One step: which requests run and how many tokens each computes."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to compute this step (prompt chunk, decode, drafts).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # req_id -> draft tokens to verify (only requests that have any).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> indices of the multimodal items whose encoder runs this step.
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    num_common_prefix_blocks: int = 0
    # Requests finished since the previous step: the runner drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # Preempted in this step: the runner drops their state; they come back resumed.
    preempted_req_ids: set[str] = field(default_factory=set)
    # Encoder outputs (by mm hash) the runner may free.
    free_encoder_input_ids: list[str] = field(default_factory=list)
    # req_id -> row of the grammar bitmask, for requests with structured output.
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: Any = None
    kv_connector_metadata: Any = None

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled_tokens)
