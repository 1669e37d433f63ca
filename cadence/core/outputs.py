"""What flows back from a step: runner results in, per-client outputs and stats out.

``ModelRunnerOutput`` is produced by a runner (real or simulated) for one
``SchedulerOutput``. ``EngineCoreOutput(s)`` and the stats are what the
scheduler returns from ``update_from_output``; they are msgspec structs so a
front-end process can receive them cheaply over a socket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection

import msgspec

from cadence.core.request import FinishReason, RequestEvent


class LogprobsLists(msgspec.Struct, gc=False):
    """Top-k logprobs of sampled tokens, one row per sampled token.

    Row r: ``logprob_token_ids[r][0]`` is the sampled token, then its top-k.
    A runner's step output may hold several rows per request (accepted
    drafts): ``cu_num_generated_tokens[i]:cu_num_generated_tokens[i + 1]``
    are request i's rows; without it, row i is request i's.
    """

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]
    cu_num_generated_tokens: list[int] | None = None

    def slice(self, start: int, end: int) -> "LogprobsLists":
        return LogprobsLists(
            self.logprob_token_ids[start:end],
            self.logprobs[start:end],
            self.sampled_token_ranks[start:end],
        )

    def rows_of(self, req_index: int) -> "LogprobsLists":
        """The rows of the ``req_index``-th request of a step."""
        if self.cu_num_generated_tokens is None:
            return self.slice(req_index, req_index + 1)
        cu = self.cu_num_generated_tokens
        return self.slice(cu[req_index], cu[req_index + 1])


@dataclass(slots=True)
class KVConnectorOutput:
    """Transfers the worker side of a KV connector finished during a step."""

    # Request ids: a set, or any collection (the simulator keeps the order transfers ended in).
    finished_sending: Collection[str] | None = None
    finished_recving: Collection[str] | None = None
    # Blocks whose load failed or timed out: their contents cannot be trusted,
    # the tokens they hold are computed again.
    invalid_block_ids: set[int] | None = None


@dataclass(slots=True)
class ModelRunnerOutput:
    """The runner's result for one step.

    ``sampled_token_ids[i]`` belongs to ``req_ids[i]``: empty for a prefill
    chunk that does not reach the end of the prompt, one token for a plain
    decode, 1 + accepted drafts with speculative decoding.
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    spec_token_ids: list[list[int]] | None = None
    logprobs: LogprobsLists | None = None
    # req_id -> (token_ids, logprobs, ranks) rows for prompt positions computed this step.
    prompt_logprobs_dict: dict[str, Any] = field(default_factory=dict)
    # Per request of the step (as ``req_ids``): the pooled hidden state of a
    # pooling request whose prompt ended in this step, else None; [] when the
    # step has no such request.
    pooler_output: list[list[float] | None] = field(default_factory=list)
    kv_connector_output: KVConnectorOutput | None = None
    num_nans_in_logits: dict[str, int] | None = None
    # req_id -> why the runner cannot serve it (its LoRA adapter cannot be
    # loaded again, ...): the engine fails those requests, and only those.
    failed_requests: dict[str, str] | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])


class PrefixCacheStats(msgspec.Struct, gc=False):
    """Prefix-cache lookups since the last stats: tokens queried and hit."""

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


class SpecDecodingStats(msgspec.Struct, gc=False):
    """Draft acceptance over one step."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []

    @classmethod
    def new(cls, num_spec_tokens: int) -> "SpecDecodingStats":
        return cls(num_spec_tokens, num_accepted_tokens_per_pos=[0] * num_spec_tokens)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1

    def add(self, other: "SpecDecodingStats") -> None:
        """Count ``other``'s drafts in too (totals over many steps)."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for pos, count in enumerate(other.num_accepted_tokens_per_pos):
            if pos < len(self.num_accepted_tokens_per_pos):
                self.num_accepted_tokens_per_pos[pos] += count
            else:
                self.num_accepted_tokens_per_pos.append(count)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft tokens / drafted tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a verifying step yields per request: 1 + accepted drafts (vLLM's measure)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


class SchedulerStats(msgspec.Struct, gc=False):
    """A snapshot of the scheduler after a step."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    # With KV cache groups: each group's share of the blocks ("0:full", "1:window512", ...);
    # None with one group of full attention.
    kv_cache_group_usage: dict[str, float] | None = None
    prefix_cache_stats: PrefixCacheStats = msgspec.field(default_factory=PrefixCacheStats)
    spec_decoding_stats: SpecDecodingStats | None = None
    num_corrupted_reqs: int = 0
    num_preemptions: int = 0  # in the step just scheduled
    # Preemptions that swapped KV to a tier (not recomputed), since the last stats.
    num_swapped_preemptions: int = 0
    step_counter: int = 0
    # Tokens served per client since start (policy fair), a bounded set of names.
    client_service: dict[str, int] | None = None
    # Tokens looked up beyond the local prefix cache through a KV connector
    # (e.g. the host-memory tier) and found there.
    connector_prefix_cache_stats: PrefixCacheStats | None = None
    # Requests the step-time bound lets run at once now (step_time_target_s; None without one).
    running_seats: int | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """New tokens of one request from one step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    num_cached_tokens: int = 0
    events: list[RequestEvent] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # Set on a child of a parallel-sampling (n > 1) request.
    parent_request_id: str | None = None
    # A pooling request's pooled hidden state (it finishes with it).
    pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Everything one client gets from one step."""

    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    finished_requests: set[str] | None = None
    timestamp: float = 0.0
