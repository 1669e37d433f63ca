"""Fakes for the scheduler-feature tests: a one-line scheduler, a fake runner,
a step helper, and an in-memory KV connector.

``FakeRunner`` keeps its own copy of each request's tokens (as a real
runner's persistent batch does) and never looks at a ``Request``. For each
scheduled request it returns one sampled token when the scheduled range
reaches the end of the tokens it knows, else ``[]``. The token is
``token_fn(req_id, tokens_so_far)``; the default depends only on the
sequence, like greedy decoding, so outputs do not depend on batching.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from typing import Any, Callable, Iterable

from cadence.config import CacheConfig, LoRAConfig, SchedulerConfig
from cadence.core.outputs import EngineCoreOutput, KVConnectorOutput, ModelRunnerOutput
from cadence.core.request import LoRARequest, PlaceholderRange, Request
from cadence.core.sched.kv_connector import KVConnectorBase
from cadence.core.sched.output import SchedulerOutput
from cadence.core.sched.scheduler import Scheduler
from cadence.sampling_params import SamplingParams

_SCHED_FIELDS = {f.name for f in dataclasses.fields(SchedulerConfig)}
_CACHE_FIELDS = {f.name for f in dataclasses.fields(CacheConfig)}


def new_scheduler(
    *,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    block_size: int = 4,
    num_gpu_blocks: int = 64,
    max_loras: int | None = None,
    **kwargs: Any,
) -> Scheduler:
    """A scheduler with small configs. Keyword arguments go to ``SchedulerConfig``,
    ``CacheConfig`` or ``Scheduler`` by name."""
    sched_kw = {k: kwargs.pop(k) for k in list(kwargs) if k in _SCHED_FIELDS}
    cache_kw = {k: kwargs.pop(k) for k in list(kwargs) if k in _CACHE_FIELDS}
    lora_config = LoRAConfig(max_loras=max_loras) if max_loras is not None else None
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            **sched_kw,
        ),
        CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks, **cache_kw),
        lora_config=lora_config,
        **kwargs,
    )


def prompt_of(req_id: str, length: int, base: int | None = None) -> list[int]:
    """Deterministic prompt tokens, distinct per request id unless ``base`` is given."""
    if base is None:
        base = 1000 + zlib.crc32(req_id.encode()) % 50_000
    return [base + i for i in range(length)]


def new_request(
    req_id: str,
    prompt: int | list[int],
    *,
    max_tokens: int = 4,
    lora_id: int | None = None,
    mm: Iterable[tuple[int, int]] | None = None,
    mm_hashes: list[str] | None = None,
    eos_token_id: int | None = None,
    priority: int = 0,
    arrival_time: float | None = None,
    client_index: int = 0,
    **params: Any,
) -> Request:
    """A greedy request. ``prompt`` is a token list or a length; ``mm`` is
    (offset, length) pairs of multimodal placeholders."""
    tokens = prompt_of(req_id, prompt) if isinstance(prompt, int) else list(prompt)
    lora = LoRARequest(f"lora{lora_id}", lora_id) if lora_id is not None else None
    mm_positions = [PlaceholderRange(o, n) for o, n in mm] if mm else None
    return Request(
        req_id,
        tokens,
        SamplingParams(max_tokens=max_tokens, temperature=0.0, **params),
        eos_token_id=eos_token_id,
        arrival_time=arrival_time,
        priority=priority,
        client_index=client_index,
        lora_request=lora,
        mm_positions=mm_positions,
        mm_hashes=mm_hashes,
    )


def greedy_token(req_id: str, tokens: list[int]) -> int:
    """The 'model's' next token: a function of the whole sequence (not of the id)."""
    acc = 7
    for pos, tok in enumerate(tokens):
        acc = (acc * 131 + tok * (pos + 3)) % 1_000_003
    return 10 + acc % 900


class FakeRunner:
    """Executes a ``SchedulerOutput`` from its own per-request token copies."""

    def __init__(self, token_fn: Callable[[str, list[int]], int] = greedy_token) -> None:
        self.token_fn = token_fn
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.num_sampled: dict[str, int] = {}  # positions sampled per request, ever
        self.num_steps = 0

    def execute(
        self, so: SchedulerOutput, kv_connector_output: KVConnectorOutput | None = None
    ) -> ModelRunnerOutput:
        self.num_steps += 1
        for req_id in so.finished_req_ids:
            self.tokens.pop(req_id, None)
            self.computed.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            self.computed[req_id] = cached.num_computed_tokens[i]
        req_ids = list(so.num_scheduled_tokens)
        sampled = [self._run_one(req_id, so.num_scheduled_tokens[req_id]) for req_id in req_ids]
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_connector_output,
        )

    def _run_one(self, req_id: str, num_new: int) -> list[int]:
        tokens = self.tokens[req_id]
        end = self.computed[req_id] + num_new
        assert end <= len(tokens), f"{req_id}: scheduled past its known tokens"
        self.computed[req_id] = end
        if end < len(tokens):
            return []  # a prefill chunk short of the end samples nothing
        token = self.token_fn(req_id, tokens)
        tokens.append(token)
        self.num_sampled[req_id] = self.num_sampled.get(req_id, 0) + 1
        return [token]


def flatten(result: dict[int, Any]) -> list[EngineCoreOutput]:
    return [o for eco in result.values() for o in eco.outputs]


def step(
    scheduler: Scheduler,
    runner: FakeRunner,
    kv_connector_output: KVConnectorOutput | None = None,
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """schedule -> runner -> update_from_output; returns the step's output and outputs."""
    so = scheduler.schedule()
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens <= scheduler.max_num_scheduled_tokens
    assert len(scheduler.running) <= scheduler.max_num_running_reqs
    result = scheduler.update_from_output(so, runner.execute(so, kv_connector_output))
    return so, flatten(result)


def run_until_done(
    scheduler: Scheduler,
    runner: FakeRunner | None = None,
    max_steps: int = 500,
    on_step: Callable[[SchedulerOutput], None] | None = None,
) -> dict[str, list[EngineCoreOutput]]:
    """Step until no request is left; returns every request's outputs.

    ``on_step`` sees each ``SchedulerOutput`` before its update."""
    runner = runner or FakeRunner()
    outputs: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(max_steps):
        if not scheduler.has_requests():
            return outputs
        so = scheduler.schedule()
        if on_step is not None:
            on_step(so)  # before update_from_output: scheduled requests are all still known
        result = scheduler.update_from_output(so, runner.execute(so))
        step_outputs = flatten(result)
        scheduler.kv_cache_manager.check_consistency()
        for out in step_outputs:
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError(f"requests left after {max_steps} steps: {scheduler.requests}")


def run_pipelined(
    s: Scheduler,
    runner: FakeRunner | None = None,
    max_steps: int = 500,
    on_schedule: Callable[[SchedulerOutput], None] | None = None,
) -> dict[str, list[EngineCoreOutput]]:
    """Keep one step in flight: schedule and execute step t+1 before updating step t."""
    runner = runner or FakeRunner()
    outputs = {}
    in_flight = None
    for _ in range(max_steps):
        next_step = None
        if s.has_requests():
            so = s.schedule()
            if on_schedule is not None:
                on_schedule(so)
            next_step = (so, runner.execute(so))
        if in_flight is not None:
            for out in flatten(s.update_from_output(*in_flight)):
                outputs.setdefault(out.request_id, []).append(out)
            s.kv_cache_manager.check_consistency()
        in_flight = next_step
        if in_flight is None and not s.has_requests():
            return outputs
    raise AssertionError("requests left")


def all_blocks_free(scheduler: Scheduler) -> bool:
    kv = scheduler.kv_cache_manager
    return kv.num_free_blocks == kv.block_pool.num_blocks and not kv.req_to_blocks


def ref_counts(scheduler: Scheduler, block_ids: Iterable[int]) -> list[int]:
    blocks = scheduler.kv_cache_manager.block_pool.blocks
    return [blocks[b].ref_cnt for b in block_ids]


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.001)


# ----------------------------------------------------------------------
# An in-memory KV connector
# ----------------------------------------------------------------------


class InMemoryConnector(KVConnectorBase):
    """An external KV store keyed by token prefixes of whole blocks.

    ``store(tokens)`` (or a finished request, when ``save_on_finish``) puts
    the KV of every full-block prefix of ``tokens`` in the store. For a new
    request it claims the longest stored prefix beyond the local hits,
    leaving at least one prompt token to compute. With ``load_async`` the
    request waits in ``WAITING_FOR_REMOTE_KVS`` until the test reports
    ``finished_recving``; with ``delay_free`` a finished request keeps its
    blocks until the test reports ``finished_sending``.
    """

    def __init__(
        self,
        block_size: int,
        *,
        load_async: bool = False,
        delay_free: bool = False,
        save_on_finish: bool = False,
    ) -> None:
        self.block_size = block_size
        self.load_async = load_async
        self.delay_free = delay_free
        self.save_on_finish = save_on_finish
        self.prefixes: set[tuple[int, ...]] = set()
        # Call records, for the tests.
        self.match_calls: list[tuple[str, int]] = []
        self.alloc_calls: list[tuple[str, list[int], int]] = []
        self.meta_calls: list[SchedulerOutput] = []
        self.connector_outputs: list[KVConnectorOutput] = []
        self.finished_calls: list[tuple[str, list[int]]] = []
        self.sending: set[str] = set()
        self.shut_down = False
        self._pending_loads: list[tuple[str, list[int], int]] = []

    def store(self, tokens: list[int]) -> None:
        bs = self.block_size
        for end in range(bs, len(tokens) + 1, bs):
            self.prefixes.add(tuple(tokens[:end]))

    def num_stored_tokens(self, tokens: list[int]) -> int:
        bs = self.block_size
        num = 0
        for end in range(bs, len(tokens) + 1, bs):
            if tuple(tokens[:end]) not in self.prefixes:
                break
            num = end
        return num

    # ---- hooks ---------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        self.match_calls.append((request.request_id, num_computed_tokens))
        tokens = request.all_token_ids
        # Leave at least one token to compute, so the request gets logits.
        limit = (len(tokens) - 1) // self.block_size * self.block_size
        num_hit = min(self.num_stored_tokens(tokens), limit)
        num_external = max(0, num_hit - num_computed_tokens)
        return num_external, self.load_async and num_external > 0

    def update_state_after_alloc(self, request: Request, blocks: list, num_external_tokens: int) -> None:
        block_ids = [b.block_id for b in blocks]
        self.alloc_calls.append((request.request_id, block_ids, num_external_tokens))
        if num_external_tokens > 0:
            self._pending_loads.append((request.request_id, block_ids, num_external_tokens))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> dict[str, Any]:
        self.meta_calls.append(scheduler_output)
        loads, self._pending_loads = self._pending_loads, []
        return {"step": len(self.meta_calls), "loads": loads}

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.connector_outputs.append(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.finished_calls.append((request.request_id, list(block_ids)))
        if self.save_on_finish:
            self.store(request.prompt_token_ids)
        if not self.delay_free:
            return False, None
        self.sending.add(request.request_id)
        return True, {"remote_block_ids": list(block_ids)}

    def shutdown(self) -> None:
        self.shut_down = True
