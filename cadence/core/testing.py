"""A fake model runner and small builders, for tests and benchmarks of the scheduler.

Pure Python, like the rest of ``cadence.core``:

    scheduler = new_scheduler(max_num_seqs=4)     # small configs; any option by name
    scheduler.add_request(new_request("a", 10, max_tokens=3))
    outputs = run_until_done(scheduler, FakeRunner())   # req_id -> its EngineCoreOutputs
    core = EngineCore(scheduler, FakeRunner())          # it is also the engine's runner

Every fake runner follows one rule, ``samples()``: a request samples when
this step's scheduled tokens reach the end of its known tokens (prompt and
sampled so far). ``FakeRunner`` here (the tests' runner, and the one
``bench/sched_overhead.py`` times the scheduler against) and the simulator's
``SimRunner`` both call it. Which token comes out is the runner's
``token_fn``: ``greedy_token`` (a function of the whole sequence, as with
greedy decoding, so a stream never depends on batching, chunking, caching or
preemption), ``fixed_token(t)``, or any function of (req_id, tokens); with a
``draft_fn`` the runner also proposes drafts and verifies them.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable, Iterable, Sequence

from cadence.config import CacheConfig, LoRAConfig, SchedulerConfig
from cadence.core.outputs import EngineCoreOutput, EngineCoreOutputs, KVConnectorOutput, ModelRunnerOutput
from cadence.core.request import LoRARequest, PlaceholderRange, Request
from cadence.core.runner_api import RunnerBase
from cadence.core.sched.output import SchedulerOutput
from cadence.core.sched.scheduler import Scheduler
from cadence.sampling_params import SamplingParams

# (req_id, the request's tokens so far) -> the next token.
TokenFn = Callable[[str, list[int]], int]
# (req_id, the request's tokens so far) -> draft tokens for the next step.
DraftFn = Callable[[str, list[int]], list[int]]


def samples(num_computed_tokens: int, num_scheduled_tokens: int, num_known_tokens: int) -> bool:
    """Whether a scheduled request samples in this step: its computed tokens
    (before the step) plus the scheduled ones reach the end of the tokens the
    runner knows (prompt + sampled). Scheduled drafts lie beyond that end.

        tokens:     p0 p1 p2 p3 p4 p5 | d0 d1     (6 known; d: drafts, when scheduled)
        computed:   p0 p1 p2
        scheduled:           p3 p4          -> 5 < 6: a prefill chunk, samples nothing
        scheduled:           p3 p4 p5       -> 6 = 6: samples (a plain step)
        scheduled:           p3 p4 p5 d0 d1 -> 8 > 6: samples (and verifies d0, d1)
    """
    return num_computed_tokens + num_scheduled_tokens >= num_known_tokens


# ----------------------------------------------------------------------
# Token choice
# ----------------------------------------------------------------------


def greedy_token(req_id: str, tokens: Sequence[int]) -> int:
    """The 'model's' next token, in [10, 910): a function of every token and
    its position, never of the request id (that is there for other token
    functions)."""
    acc = 7
    for pos, tok in enumerate(tokens):
        acc = (acc * 131 + tok * (pos + 3)) % 1_000_003
    return 10 + acc % 900


def fixed_token(token_id: int) -> TokenFn:
    """A token function that always answers ``token_id``."""
    return lambda req_id, tokens: token_id


def greedy_stream(prompt: Sequence[int], num_tokens: int, token_fn: TokenFn = greedy_token,
                  req_id: str = "") -> list[int]:
    """The ``num_tokens`` tokens ``token_fn`` produces after ``prompt``, one at a time."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(token_fn(req_id, tokens))
    return tokens[len(prompt):]


def verify_drafts(token_fn: TokenFn, req_id: str, tokens: list[int], drafts: Sequence[int]) -> list[int]:
    """The tokens a step with ``drafts`` samples: the model's own token at each
    draft position up to (and with) the first that differs, or, when every
    draft is right, all of them and one more (as rejection sampling at
    temperature 0 does)."""
    out: list[int] = []
    for draft in drafts:
        expected = token_fn(req_id, tokens + out)
        out.append(expected)
        if draft != expected:
            return out
    out.append(token_fn(req_id, tokens + out))
    return out


# ----------------------------------------------------------------------
# The fake runner
# ----------------------------------------------------------------------


class FakeRunner(RunnerBase):
    """The model runner's interface (``execute_model``), with a token function
    instead of a model.

    Like a real runner's persistent batch it keeps its own copy of each
    request's tokens from the ``SchedulerOutput`` deltas and never reads a
    ``Request``; it checks what the scheduler sends against that copy: a
    running request's computed count, nothing scheduled past the known tokens
    and drafts, and (given ``block_size``) blocks that cover every position
    computed in the step.

    With ``check_kv`` (and ``block_size``) it also keeps a shadow KV cache,
    ``ShadowKV``: each step writes every scheduled position's token id into
    the slot its block table maps it to, then checks that every position the
    step attends to holds the token it should, which is what a real model
    reads. A block handed out as a prefix-cache hit that no step wrote fails
    here, even when the token streams come out right.

    ``sliding_windows`` (one per KV cache group, ``kv_cache/groups.py``): block
    ids come as one list per group; a window group's step reads only the
    positions its window shows (from the step's first query - W + 1 on), and
    no step may write the null block (0).
    """

    def __init__(
        self,
        token_fn: TokenFn = greedy_token,
        *,
        draft_fn: DraftFn | None = None,
        block_size: int | None = None,
        check_kv: bool = False,
        sliding_windows: tuple[int | None, ...] | None = None,
    ) -> None:
        self.token_fn = token_fn
        self.sliding_windows = sliding_windows
        self.draft_fn = draft_fn
        self.block_size = block_size
        if check_kv and block_size is None:
            raise ValueError("check_kv: the shadow KV cache needs block_size")
        self.shadow_kv = ShadowKV(block_size) if check_kv else None
        self.tokens: dict[str, list[int]] = {}  # req_id -> prompt + sampled
        self.computed: dict[str, int] = {}
        self.block_ids: dict[str, list[int]] = {}
        self.num_sampled: dict[str, int] = {}  # tokens sampled per request, ever
        # Pooling requests: they sample nothing; the step that computes their
        # prompt's last token answers their "pooled state", [prompt length].
        self.pooling: set[str] = set()
        self.num_steps = 0

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: one token list per scheduled request (empty for a
        prefill chunk short of the end), and drafts when there is a ``draft_fn``."""
        self.num_steps += 1
        self._update_states(scheduler_output)
        scheduled = scheduler_output.num_scheduled_tokens
        drafts = scheduler_output.scheduled_spec_decode_tokens
        req_ids = list(scheduled)
        if self.shadow_kv is not None:
            self._check_kv(scheduled, drafts)
        pooled = [self._pool_one(r, scheduled[r]) if r in self.pooling else None for r in req_ids]
        sampled = [[] if r in self.pooling else self._run_one(r, scheduled[r], drafts.get(r, ()))
                   for r in req_ids]
        proposed = None
        if self.draft_fn is not None:  # drafts for the next step, from the tokens known now
            proposed = [self.draft_fn(req_id, self.tokens[req_id]) for req_id in req_ids]
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled,
            spec_token_ids=proposed,
            pooler_output=pooled if self.pooling else [],
        )

    def _pool_one(self, req_id: str, num_scheduled: int) -> list[float] | None:
        """A pooling request's step: its "pooled state" once its prompt is computed."""
        tokens = self.tokens[req_id]
        end = self.computed[req_id] + num_scheduled
        assert end <= len(tokens), f"{req_id}: a pooling request scheduled past its prompt"
        self.computed[req_id] = end
        return [float(len(tokens))] if end == len(tokens) else None

    def execute(
        self, scheduler_output: SchedulerOutput, kv_connector_output: KVConnectorOutput | None = None
    ) -> ModelRunnerOutput:
        """``execute_model``, with a KV connector's output attached (a real
        runner gets it from its connector; a test makes it up)."""
        output = self.execute_model(scheduler_output)
        output.kv_connector_output = kv_connector_output
        return output

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.pooling.discard(req_id)
            self.tokens.pop(req_id, None)
            self.computed.pop(req_id, None)
            self.block_ids.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
            self.block_ids[new.req_id] = _copy_ids(new.block_ids)
            if new.sampling_params.pooling is not None:
                self.pooling.add(new.req_id)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if cached.resumed_from_preemption[i]:
                self.block_ids[req_id] = _copy_ids(cached.new_block_ids[i])  # the whole new list
            else:
                assert self.computed[req_id] == cached.num_computed_tokens[i], (
                    f"{req_id}: scheduler says {cached.num_computed_tokens[i]} computed, "
                    f"runner has {self.computed[req_id]}"
                )
                _extend_ids(self.block_ids[req_id], cached.new_block_ids[i])
            self.computed[req_id] = cached.num_computed_tokens[i]

    def _check_kv(self, scheduled: dict[str, int], drafts: dict[str, list[int]]) -> None:
        """Write the step's positions into the shadow cache, then check every
        position each request attends to (a real runner, per layer, also
        writes the whole step's keys before any attention reads them)."""
        shadow = self.shadow_kv
        spans = []
        for req_id, num_scheduled in scheduled.items():
            tokens = self.tokens[req_id] + list(drafts.get(req_id, ()))
            start = self.computed[req_id]
            spans.append((req_id, tokens, start, start + num_scheduled))
        if self.sliding_windows is None:
            for req_id, tokens, start, end in spans:
                shadow.write(self.block_ids[req_id], tokens, start, end)
            for req_id, tokens, start, end in spans:
                shadow.check_reads(req_id, self.block_ids[req_id], tokens, end)
            return
        for req_id, tokens, start, end in spans:
            for block_ids in self.block_ids[req_id]:
                assert all(block_ids[p // shadow.block_size] != 0 for p in range(start, end)), (
                    f"{req_id}: a step writes the null block")
                shadow.write(block_ids, tokens, start, end)
        for req_id, tokens, start, end in spans:
            for block_ids, window in zip(self.block_ids[req_id], self.sliding_windows):
                first = 0 if window is None else max(0, start - window + 1)
                shadow.check_reads(req_id, block_ids, tokens, end, first)

    def _run_one(self, req_id: str, num_scheduled: int, drafts: Sequence[int]) -> list[int]:
        tokens = self.tokens[req_id]
        start = self.computed[req_id]
        end = start + num_scheduled
        assert end <= len(tokens) + len(drafts), f"{req_id}: scheduled past its known tokens"
        if self.block_size is not None:
            block_ids = self.block_ids[req_id]
            for ids in (block_ids if isinstance(block_ids, tuple) else (block_ids,)):
                assert len(ids) * self.block_size >= end, f"{req_id}: too few blocks"
        if not samples(start, num_scheduled, len(tokens)):
            self.computed[req_id] = end
            return []
        if drafts:
            out = verify_drafts(self.token_fn, req_id, tokens, drafts)
        else:
            out = [self.token_fn(req_id, tokens)]
        tokens.extend(out)
        self.computed[req_id] = end - (len(drafts) + 1 - len(out))  # rejected drafts are not computed
        self.num_sampled[req_id] = self.num_sampled.get(req_id, 0) + len(out)
        return out


class KVContentError(AssertionError):
    """A step attended to a KV slot that does not hold its position's token."""


class ShadowKV:
    """What a paged KV cache would hold, one token id per slot.

    Slot of position ``p`` of a request with block table ``blocks``:

        position p  ->  block blocks[p // block_size], offset p % block_size

    A block keeps what was last written to it after its owner frees it,
    as real cache memory does: a prefix-cache hit reads that.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[tuple[int, int], int] = {}  # (block id, offset) -> token id
        self.num_reads_checked = 0

    def write(self, block_ids: list[int], tokens: Sequence[int], start: int, end: int) -> None:
        size = self.block_size
        for pos in range(start, end):
            self.slots[(block_ids[pos // size], pos % size)] = tokens[pos]

    def check_reads(
        self, req_id: str, block_ids: list[int], tokens: Sequence[int], end: int, first: int = 0
    ) -> None:
        """Every position from ``first`` (a window's first visible key) to ``end``
        (the causal context of the step's last row)."""
        size, slots = self.block_size, self.slots
        for pos in range(first, end):
            slot = (block_ids[pos // size], pos % size)
            held = slots.get(slot)
            if held != tokens[pos]:
                raise KVContentError(
                    f"{req_id}: position {pos} reads block {slot[0]} offset {slot[1]}, which holds "
                    f"{'nothing written' if held is None else f'token {held}'}, not token {tokens[pos]}"
                )
        self.num_reads_checked += end - first


def _copy_ids(block_ids):
    """A request's block ids as sent (a list, or one list per KV cache group), copied."""
    if isinstance(block_ids, tuple):
        return tuple(list(ids) for ids in block_ids)
    return list(block_ids)


def _extend_ids(block_ids, new_block_ids) -> None:
    if isinstance(block_ids, tuple):
        for ids, new in zip(block_ids, new_block_ids):
            ids.extend(new)
    else:
        block_ids.extend(new_block_ids)


# ----------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------

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
    """Deterministic prompt tokens (from 1000 up), distinct per request id unless ``base`` is given."""
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
    """A greedy request. ``prompt`` is a token list or a length (``prompt_of``);
    ``mm`` is (offset, length) pairs of multimodal placeholders; other keyword
    arguments go to ``SamplingParams``."""
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


# ----------------------------------------------------------------------
# Driving the scheduler
# ----------------------------------------------------------------------


def flatten(result: dict[int, EngineCoreOutputs]) -> list[EngineCoreOutput]:
    """Every client's outputs of one step, in one list."""
    return [o for eco in result.values() for o in eco.outputs]


def step(
    scheduler: Scheduler,
    runner: FakeRunner,
    kv_connector_output: KVConnectorOutput | None = None,
    on_schedule: Callable[[SchedulerOutput], None] | None = None,
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """schedule -> runner -> update_from_output, checking the step's budgets;
    returns the step's ``SchedulerOutput`` and outputs. ``on_schedule`` sees
    the ``SchedulerOutput`` before the update (while every scheduled request
    is still known)."""
    so = scheduler.schedule()
    if on_schedule is not None:
        on_schedule(so)
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens <= scheduler.max_num_scheduled_tokens
    assert scheduler.get_request_counts()[0] <= scheduler.max_num_running_reqs
    result = scheduler.update_from_output(so, runner.execute(so, kv_connector_output))
    return so, flatten(result)


def run_until_done(
    scheduler: Scheduler,
    runner: FakeRunner | None = None,
    max_steps: int = 10_000,
    on_step: Callable[[SchedulerOutput], None] | None = None,
    check_blocks: bool = True,
) -> dict[str, list[EngineCoreOutput]]:
    """Step until no request is left; returns every request's outputs.

    ``on_step`` sees each ``SchedulerOutput`` before its update;
    ``check_blocks`` checks the KV cache's consistency after every step."""
    runner = runner or FakeRunner(block_size=scheduler.block_size, check_kv=True)
    outputs: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(max_steps):
        if not scheduler.has_requests():
            return outputs
        _, step_outputs = step(scheduler, runner, on_schedule=on_step)
        for out in step_outputs:
            outputs.setdefault(out.request_id, []).append(out)
        if check_blocks:
            scheduler.kv_cache_manager.check_consistency()
    raise AssertionError(f"requests (running, waiting) left after {max_steps} steps: "
                         f"{scheduler.get_request_counts()}")


def run_pipelined(
    scheduler: Scheduler,
    runner: FakeRunner | None = None,
    max_steps: int = 10_000,
    on_schedule: Callable[[SchedulerOutput], None] | None = None,
) -> dict[str, list[EngineCoreOutput]]:
    """Keep one step in flight (async scheduling): schedule and execute step
    t+1 before updating step t; returns every request's outputs."""
    runner = runner or FakeRunner(block_size=scheduler.block_size, check_kv=True)
    outputs: dict[str, list[EngineCoreOutput]] = {}
    in_flight = None
    for _ in range(max_steps):
        next_step = None
        if scheduler.has_requests():
            so = scheduler.schedule()
            if on_schedule is not None:
                on_schedule(so)
            next_step = (so, runner.execute(so))
        if in_flight is not None:
            for out in flatten(scheduler.update_from_output(*in_flight)):
                outputs.setdefault(out.request_id, []).append(out)
            scheduler.kv_cache_manager.check_consistency()
        in_flight = next_step
        if in_flight is None and not scheduler.has_requests():
            return outputs
    raise AssertionError(f"requests (running, waiting) left after {max_steps} steps: "
                         f"{scheduler.get_request_counts()}")


def token_streams(outputs: dict[str, list[EngineCoreOutput]]) -> dict[str, list[int]]:
    """Each request's streamed tokens, from ``run_until_done``'s outputs."""
    return {req_id: [t for o in outs for t in o.new_token_ids] for req_id, outs in outputs.items()}


def all_blocks_free(scheduler: Scheduler) -> bool:
    """Every KV block back in the pool, and no request holding any."""
    kv = scheduler.kv_cache_manager
    return kv.num_free_blocks + kv.num_reserved_blocks == kv.block_pool.num_blocks and not kv.req_to_blocks


def sequences_held(kv: Any, num_tokens: int, chunk: int) -> int:
    """Sequences of ``num_tokens`` tokens a KV cache manager holds at once: each
    prefilled in ``chunk``-token pieces, as the scheduler allocates them, then
    decoding (a window group then holds its window, not the last chunk), until
    the pool refuses one. Everything is freed again before it returns."""
    held = []
    while True:
        request = new_request(f"held{len(held)}", num_tokens - 1, max_tokens=1)
        pieces = [chunk] * ((num_tokens - 1) // chunk) + [(num_tokens - 1) % chunk]
        for piece in pieces:
            if kv.allocate_slots(request, piece) is None:
                break
            request.num_computed_tokens += piece
        else:
            request.append_output_token_ids(7)  # it decodes
            if kv.allocate_slots(request, 1) is not None:
                held.append(request)
                continue
        kv.free(request)
        break
    for request in held:
        kv.free(request)
    kv.check_consistency()
    return len(held)


def ref_counts(scheduler: Scheduler, block_ids: Iterable[int]) -> list[int]:
    blocks = scheduler.kv_cache_manager.block_pool.blocks
    return [blocks[b].ref_cnt for b in block_ids]
