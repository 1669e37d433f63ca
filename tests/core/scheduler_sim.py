"""Shared helpers for the pure-Python scheduler tests.

``ModelRunnerSim`` plays the model: it keeps its own copy of each request's
tokens (like a real runner's persistent batch), checks what the scheduler
sends against it, and "samples" a token that is a deterministic function of
the whole sequence so far, like greedy decoding of a real model. So token
streams must not depend on batching, chunking, caching or preemption.
"""

from __future__ import annotations

from typing import Callable

from cadence.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from cadence.core.outputs import EngineCoreOutput, ModelRunnerOutput
from cadence.core.request import Request
from cadence.core.sched.output import SchedulerOutput
from cadence.core.sched.scheduler import Scheduler
from cadence.sampling_params import SamplingParams

VOCAB = 1000


def model_token(tokens: list[int]) -> int:
    """The 'greedy token' after a sequence: depends on every token and its position."""
    acc = 17
    for i, tok in enumerate(tokens):
        acc = (acc * 31 + tok * (i + 7)) % 1_000_003
    return 100 + acc % VOCAB


def make_scheduler(
    *,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 1024,
    num_blocks: int = 200,
    block_size: int = 4,
    prefix_caching: bool = True,
    log_stats: bool = True,
    speculative_config: SpeculativeConfig | None = None,
    include_finished_set: bool = False,
    cache_kwargs: dict | None = None,
    **scheduler_kwargs,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            **scheduler_kwargs,
        ),
        CacheConfig(
            block_size=block_size,
            num_gpu_blocks=num_blocks,
            enable_prefix_caching=prefix_caching,
            **(cache_kwargs or {}),
        ),
        speculative_config=speculative_config,
        log_stats=log_stats,
        include_finished_set=include_finished_set,
    )


def make_request(
    req_id: str,
    prompt: list[int] | int,
    *,
    max_tokens: int = 8,
    eos_token_id: int | None = None,
    priority: int = 0,
    arrival_time: float = 0.0,
    client_index: int = 0,
    **params,
) -> Request:
    if isinstance(prompt, int):
        prompt = [1000 + (hash(req_id) + i) % 5000 for i in range(prompt)]
    params.setdefault("ignore_eos", eos_token_id is None)
    return Request(
        req_id,
        list(prompt),
        SamplingParams(max_tokens=max_tokens, temperature=0.0, **params),
        eos_token_id=eos_token_id,
        priority=priority,
        arrival_time=arrival_time,
        client_index=client_index,
    )


class ModelRunnerSim:
    """A fake model runner that checks the scheduler's bookkeeping as it goes."""

    def __init__(
        self,
        block_size: int,
        *,
        token_fn: Callable[[list[int]], int] = model_token,
        draft_fn: Callable[[str, list[int]], list[int]] | None = None,
    ) -> None:
        self.block_size = block_size
        self.token_fn = token_fn
        self.draft_fn = draft_fn
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.block_ids: dict[str, list[int]] = {}
        self.num_steps = 0

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        for req_id in so.finished_req_ids:
            self.tokens.pop(req_id, None)
            self.block_ids.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.block_ids[new.req_id] = list(new.block_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if cached.resumed_from_preemption[i]:
                self.block_ids[req_id] = list(cached.new_block_ids[i])
            else:
                assert self.computed[req_id] == cached.num_computed_tokens[i], (
                    f"{req_id}: scheduler says {cached.num_computed_tokens[i]} computed, "
                    f"runner has {self.computed[req_id]}"
                )
                self.block_ids[req_id].extend(cached.new_block_ids[i])
            self.computed[req_id] = cached.num_computed_tokens[i]
        req_ids = list(so.num_scheduled_tokens)
        sampled, drafts = [], []
        for req_id in req_ids:
            sampled.append(self._run_one(req_id, so))
            drafts.append(self._propose(req_id))
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            spec_token_ids=drafts if self.draft_fn else None,
        )

    def _run_one(self, req_id: str, so: SchedulerOutput) -> list[int]:
        num_new = so.num_scheduled_tokens[req_id]
        drafts = so.scheduled_spec_decode_tokens.get(req_id, [])
        tokens = self.tokens[req_id]
        start = self.computed[req_id]
        end = start + num_new
        # The request's blocks must cover every position computed this step.
        assert len(self.block_ids[req_id]) * self.block_size >= end, f"{req_id}: too few blocks"
        assert end <= len(tokens) + len(drafts), f"{req_id}: scheduled past known tokens"
        if end < len(tokens):
            self.computed[req_id] = end
            return []  # a prefill chunk short of the end samples nothing
        # Verify drafts: accept while each equals the model's own token.
        out: list[int] = []
        for draft in drafts:
            expected = self.token_fn(tokens + out)
            out.append(expected)
            if draft != expected:
                break
        else:
            out.append(self.token_fn(tokens + out))
        num_rejected = len(drafts) + 1 - len(out)
        tokens.extend(out)
        self.computed[req_id] = end - num_rejected
        return out

    def _propose(self, req_id: str) -> list[int]:
        if self.draft_fn is None or req_id not in self.tokens:
            return []
        return self.draft_fn(req_id, self.tokens[req_id])


def step(scheduler: Scheduler, runner: ModelRunnerSim) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    so = scheduler.schedule()
    assert so.total_num_scheduled_tokens <= scheduler.max_num_scheduled_tokens
    assert len(scheduler.running) <= scheduler.max_num_running_reqs
    result = scheduler.update_from_output(so, runner.execute(so))
    outputs = [o for eco in result.values() for o in eco.outputs]
    return so, outputs


def run_to_completion(
    scheduler: Scheduler, runner: ModelRunnerSim | None = None, max_steps: int = 10_000,
    check_blocks: bool = True,
) -> dict[str, list[int]]:
    """Step until nothing is left; returns each request's streamed tokens."""
    runner = runner or ModelRunnerSim(scheduler.block_size)
    streams: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_requests():
            break
        _, outputs = step(scheduler, runner)
        for out in outputs:
            streams.setdefault(out.request_id, []).extend(out.new_token_ids)
        if check_blocks:
            scheduler.kv_cache_manager.check_consistency()
    else:
        raise AssertionError("scheduler did not finish")
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.block_pool.num_blocks
    return streams


def expected_stream(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(model_token(tokens))
    return tokens[len(prompt):]

