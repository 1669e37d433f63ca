"""The pure-Python scheduler tests' helpers: the harness of ``cadence.core.testing``
under the names and defaults these tests were written with.

``ModelRunnerSim(block_size)`` is the harness's ``FakeRunner`` checking block
coverage, with a token function of the sequence alone (``model_token`` by
default, the harness's greedy token). So token streams must not depend on
batching, chunking, caching or preemption.
"""

from __future__ import annotations

from typing import Callable

from cadence.config import SpeculativeConfig
from cadence.core.request import Request
from cadence.core.sched.scheduler import Scheduler
from cadence.core.testing import (  # noqa: F401  (step: re-exported for the tests)
    DraftFn,
    FakeRunner,
    greedy_stream,
    greedy_token,
    new_request,
    new_scheduler,
    run_until_done,
    step,
    token_streams,
)


def model_token(tokens: list[int]) -> int:
    """The 'greedy token' after a sequence: depends on every token and its position."""
    return greedy_token("", tokens)


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
    return new_scheduler(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        num_gpu_blocks=num_blocks,
        block_size=block_size,
        enable_prefix_caching=prefix_caching,
        log_stats=log_stats,
        speculative_config=speculative_config,
        include_finished_set=include_finished_set,
        **(cache_kwargs or {}),
        **scheduler_kwargs,
    )


def make_request(
    req_id: str,
    prompt: list[int] | int,
    *,
    max_tokens: int = 8,
    eos_token_id: int | None = None,
    arrival_time: float = 0.0,
    **params,
) -> Request:
    """A greedy request that ignores EOS unless it is given one."""
    params.setdefault("ignore_eos", eos_token_id is None)
    return new_request(req_id, prompt, max_tokens=max_tokens, eos_token_id=eos_token_id,
                       arrival_time=arrival_time, **params)


class ModelRunnerSim(FakeRunner):
    """The harness's ``FakeRunner``, checking that blocks cover each step's
    positions and (``check_kv``) what each step reads from the KV cache."""

    def __init__(
        self,
        block_size: int,
        *,
        token_fn: Callable[[list[int]], int] = model_token,
        draft_fn: DraftFn | None = None,
        check_kv: bool = True,
    ) -> None:
        super().__init__(lambda req_id, tokens: token_fn(tokens), draft_fn=draft_fn,
                         block_size=block_size, check_kv=check_kv)


def run_to_completion(
    scheduler: Scheduler, runner: ModelRunnerSim | None = None, max_steps: int = 10_000,
    check_blocks: bool = True,
) -> dict[str, list[int]]:
    """Step until nothing is left; returns each request's streamed tokens."""
    runner = runner or ModelRunnerSim(scheduler.block_size)
    streams = token_streams(run_until_done(scheduler, runner, max_steps, check_blocks=check_blocks))
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.block_pool.num_blocks
    return streams


def expected_stream(prompt: list[int], max_tokens: int) -> list[int]:
    return greedy_stream(prompt, max_tokens)
