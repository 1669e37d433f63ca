"""Random workloads that mix every scheduling feature, run against the
shadow-KV oracle (``FakeRunner(check_kv=True)``).

One workload draws a scheduler configuration (policy: fcfs, priority, fair, slo, lpm; budgets, chunking and
thresholds, partial-prefill caps, blocked bypass, prefix caching, speculative
tokens with wrong drafts or async scheduling, a host-memory tier with
recompute, swap or auto preemption and failing loads; KV cache groups with
sliding windows, whose blocks behind the window are freed, with or without
the tier, and under P/D) and requests (shared
prefixes, priorities, clients, latency targets, ``n > 1``, grammars, aborts
at random steps). The driver steps the real ``Scheduler`` and checks, every
step, what each scheduled request reads from the KV cache; at the end, every
block is free and each stream is the greedy one.

The connector's copies are executed on the shadow cache as the worker
executes them: swap-outs, then loads, before the forward; saves after it.
A failing load writes garbage into its blocks and reports them invalid, as a
worker whose transfer broke does.

``tests/core/test_kv_oracle.py`` runs a few hundred examples;
``bench/kv_oracle.py`` runs tens of thousands.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from cadence.config import KVTransferConfig, SpeculativeConfig
from cadence.core.kv_cache import KVCacheLayout, plan_kv_cache_layout
from cadence.core.kv_transfer.offloading import OffloadingConnector, OffloadingMetadata
from cadence.core.kv_transfer.pd_connector import CONSUMER, PRODUCER, PDConnectorMetadata, PDConnectorScheduler
from cadence.core.outputs import KVConnectorOutput
from cadence.core.request import RequestStatus
from cadence.core.sched.kv_connector import KVConnectorContext
from cadence.core.sched.structured_output import StructuredOutputManager, StructuredOutputRequest
from cadence.core.testing import FakeRunner, flatten, greedy_stream, greedy_token, new_request, new_scheduler
from cadence.sampling_params import StructuredOutputParams

BLOCK_SIZE = 4
BYTES_PER_BLOCK = 2**20  # a tier of N slots is N / 1024 GiB
GARBAGE = -1  # what a failed load leaves in a block


# ----------------------------------------------------------------------
# The runner: the fake runner plus the tier's copies on the shadow cache
# ----------------------------------------------------------------------


class OracleRunner(FakeRunner):
    """``FakeRunner`` with the shadow KV check on, executing an offloading
    connector's copy orders on the shadow cache; ``fail_load(req_id)`` says
    whether a request's load breaks."""

    def __init__(self, *, draft_fn=None, fail_load=lambda req_id: False, sliding_windows=None) -> None:
        super().__init__(greedy_token, draft_fn=draft_fn, block_size=BLOCK_SIZE, check_kv=True,
                         sliding_windows=sliding_windows)
        self.tier: dict[int, dict[int, int]] = {}  # slot -> {offset: token}
        self.fail_load = fail_load
        self.num_failed_loads = 0
        self.num_blocks_loaded = 0
        # A P/D worker's step: (PDConnectorMetadata) -> its connector output (see PDWorkers).
        self.connector_hook = None

    def execute(self, scheduler_output, kv_connector_output=None):
        meta = scheduler_output.kv_connector_metadata
        connector_output = None
        if isinstance(meta, OffloadingMetadata):
            connector_output = self._copy_in(meta)
        elif isinstance(meta, PDConnectorMetadata):
            connector_output = self.connector_hook(meta)
        output = self.execute_model(scheduler_output)
        if isinstance(meta, OffloadingMetadata):
            for block_id, slot, _ in meta.saves:
                self.tier[slot] = self._block(block_id)
        output.kv_connector_output = connector_output
        return output

    def _copy_in(self, meta: OffloadingMetadata) -> KVConnectorOutput | None:
        for block_id, slot, _ in meta.swap_outs:
            self.tier[slot] = self._block(block_id)
        invalid = set()
        for req_id, orders in meta.loads.items():
            fails = self.fail_load(req_id)
            for i, (block_id, slot, _) in enumerate(orders):
                if fails and i == len(orders) // 2:
                    invalid.add(block_id)
                    self.num_failed_loads += 1
                    self._fill(block_id, {offset: GARBAGE for offset in range(BLOCK_SIZE)})
                else:
                    self._fill(block_id, self.tier.get(slot, {}))
                self.num_blocks_loaded += 1
        if not meta.loads:
            return None
        return KVConnectorOutput(finished_recving=set(meta.loads), invalid_block_ids=invalid or None)

    def _block(self, block_id: int) -> dict[int, int]:
        slots = self.shadow_kv.slots
        return {o: slots[(block_id, o)] for o in range(BLOCK_SIZE) if (block_id, o) in slots}

    def _fill(self, block_id: int, content: dict[int, int]) -> None:
        slots = self.shadow_kv.slots
        for offset in range(BLOCK_SIZE):
            slots.pop((block_id, offset), None)
        for offset, token in content.items():
            slots[(block_id, offset)] = token


# ----------------------------------------------------------------------
# Grammars that accept anything (the oracle checks KV, not masks)
# ----------------------------------------------------------------------


class AnyGrammar:
    def __init__(self) -> None:
        self.num_accepted = 0

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> bool:
        self.num_accepted += len(token_ids)
        return True

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        return list(token_ids)

    def rollback(self, num_tokens: int) -> None:
        self.num_accepted -= num_tokens

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        bitmask[row] = "any"

    def is_terminated(self) -> bool:
        return False


class SteppedGrammarManager(StructuredOutputManager):
    """Grammars compile in step time, not thread time: ``tick()`` (once a
    step) completes those requested ``delay`` ticks before, so a run is
    deterministic and requests still wait in WAITING_FOR_FSM."""

    def __init__(self, delay: int) -> None:
        super().__init__(AnyGrammarBackend())
        self.delay = delay
        self._compiling: list[tuple[int, Future]] = []
        self._ticks = 0

    def grammar_init(self, request) -> None:
        future: Future = Future()
        self._compiling.append((self._ticks + self.delay, future))
        request.structured_output_request = StructuredOutputRequest(future)
        if self.delay == 0:
            self.tick(advance=False)

    def tick(self, advance: bool = True) -> None:
        if advance:
            self._ticks += 1
        still = []
        for due, future in self._compiling:
            if due <= self._ticks:
                future.set_result(self.backend.compile(None))
            else:
                still.append((due, future))
        self._compiling = still


class AnyGrammarBackend:
    def compile(self, params: Any) -> AnyGrammar:
        return AnyGrammar()

    def allocate_bitmask(self, num_rows: int) -> list:
        return [None] * num_rows

    def fill_bitmask_rows(self, grammars, rows, bitmask) -> None:
        for grammar, row in zip(grammars, rows):
            grammar.fill_bitmask(bitmask, row)


# ----------------------------------------------------------------------
# Workloads
# ----------------------------------------------------------------------


@dataclass
class Workload:
    requests: list[dict]
    scheduler: dict  # SchedulerConfig / CacheConfig fields by name
    num_spec: int = 0
    draft_accuracy: int = 0
    tier_slots: int = 0  # 0: no host tier
    preemption_mode: str = "recompute"
    failing_loads: frozenset[str] = frozenset()
    structured: bool = False
    grammar_delay: int = 0  # steps a grammar takes to compile
    # KV cache groups (window groups free the blocks behind their window); None: one group.
    layout: KVCacheLayout | None = None

    @property
    def async_scheduling(self) -> bool:
        return bool(self.scheduler.get("async_scheduling"))


@st.composite
def workloads(draw, max_requests: int = 10) -> Workload:
    policy = draw(st.sampled_from(["fcfs", "priority", "fair", "slo", "lpm"]))
    chunked = draw(st.booleans())
    budget = draw(st.integers(8, 64))
    threshold = draw(st.sampled_from([0, 0, 4, 7]))
    shared = draw(st.lists(st.integers(100, 130), max_size=12))
    # Without chunked prefill a prompt must fit the budget whole.
    max_own = 30 if chunked else max(1, budget - len(shared))
    requests = []
    for i in range(draw(st.integers(1, max_requests))):
        own = draw(st.lists(st.integers(100, 130), min_size=1, max_size=max_own))
        prompt = (shared if draw(st.booleans()) else []) + own
        if not chunked and len(prompt) > budget:
            prompt = prompt[-budget:]
        requests.append({
            "id": f"r{i}",
            "prompt": prompt,
            "max_tokens": draw(st.integers(1, 10)),
            "arrival_step": draw(st.integers(0, 8)),
            "abort_step": draw(st.none() | st.none() | st.integers(0, 25)),
            "priority": draw(st.integers(0, 3)),
            "tenant": draw(st.sampled_from([None, "a", "b"])),
            "ttft": draw(st.none() | st.floats(0.01, 1.0)),
            "n": draw(st.sampled_from([1, 1, 1, 2, 3])),
            "grammar": draw(st.booleans()),
        })
    longest = max(len(r["prompt"]) + r["max_tokens"] + 4 for r in requests)
    min_blocks = -(-longest // BLOCK_SIZE) + 2
    sched: dict[str, Any] = {
        "policy": policy,
        "max_num_batched_tokens": budget,
        "max_num_seqs": draw(st.integers(1, 6)),
        "num_gpu_blocks": draw(st.integers(min_blocks, min_blocks + 12)),
        "enable_prefix_caching": draw(st.booleans()),
        "enable_chunked_prefill": chunked,
        "long_prefill_token_threshold": threshold,
    }
    if policy == "lpm":
        sched["lpm_max_bypass"] = draw(st.sampled_from([None, 0, 2, 10**9]))
    if not chunked:
        sched["max_blocked_bypass_steps"] = draw(st.sampled_from([0, 2]))
    caps = draw(st.sampled_from([None, 1, 2]))
    if caps is not None:
        sched["max_num_partial_prefills"] = caps
        if threshold and draw(st.booleans()):
            sched["max_long_partial_prefills"] = 1
    mode = draw(st.sampled_from(["none", "sync", "spec", "async"]))
    num_spec = draw(st.integers(1, 3)) if mode == "spec" else 0
    if mode == "async":
        sched["async_scheduling"] = True
    tier_slots = draw(st.sampled_from([0, 0, 8, 64]))
    failing = frozenset(r["id"] for r in requests if draw(st.integers(0, 3)) == 0)
    layout = None
    window = draw(st.sampled_from([None, None, 1, 3, 5, 9]))
    num_layers, full_layers = draw(st.sampled_from([(2, (1,)), (3, (2,)), (2, ())]))
    if window is not None:
        layout = plan_kv_cache_layout(num_layers, window, full_layers)
        # Each group takes its blocks from the one pool, and one is the null block.
        sched["num_gpu_blocks"] = sched["num_gpu_blocks"] * layout.num_groups + 1
    return Workload(
        requests=requests, scheduler=sched, num_spec=num_spec,
        draft_accuracy=draw(st.integers(0, 3)), tier_slots=tier_slots,
        preemption_mode=draw(st.sampled_from(["recompute", "swap", "auto"])) if tier_slots else "recompute",
        failing_loads=failing if tier_slots else frozenset(),
        structured=draw(st.booleans()),
        grammar_delay=draw(st.integers(0, 2)),
        layout=layout,
    )


# ----------------------------------------------------------------------
# The driver
# ----------------------------------------------------------------------


@dataclass
class OracleRun:
    streams: dict[str, list[int]] = field(default_factory=dict)
    aborted: set[str] = field(default_factory=set)
    num_steps: int = 0
    num_preemptions: int = 0
    num_swaps: int = 0
    num_failed_loads: int = 0
    num_reads_checked: int = 0
    num_hit_tokens: int = 0


def make_drafter(num_spec: int, accuracy: int):
    """Drafts whose first ``accuracy`` tokens are right, the rest wrong."""
    def draft(req_id, tokens):
        seq, out = list(tokens), []
        for i in range(num_spec):
            tok = greedy_token(req_id, seq) if i < accuracy else 1
            out.append(tok)
            seq.append(tok)
        return out
    return draft


def build(w: Workload, clock):
    """(scheduler, runner) for a workload."""
    connector = None
    if w.tier_slots:
        context = KVConnectorContext(
            block_size=BLOCK_SIZE, num_blocks=w.scheduler["num_gpu_blocks"],
            bytes_per_block=BYTES_PER_BLOCK, seconds_per_token=1e-3, copy_bytes_per_second=1e10,
            preemption_mode=w.preemption_mode)
        connector = OffloadingConnector(
            KVTransferConfig(kv_offload_size=w.tier_slots * BYTES_PER_BLOCK / 2**30), context)
    spec = SpeculativeConfig(num_speculative_tokens=w.num_spec) if w.num_spec else None
    manager = SteppedGrammarManager(w.grammar_delay) if w.structured else None
    scheduler = new_scheduler(
        block_size=BLOCK_SIZE, max_model_len=256, log_stats=True, clock=clock,
        speculative_config=spec, kv_connector=connector, structured_output_manager=manager,
        kv_cache_layout=w.layout, **w.scheduler)
    drafter = make_drafter(w.num_spec, w.draft_accuracy) if w.num_spec else None
    failing = w.failing_loads
    already_failed: set[str] = set()

    def fail_load(req_id: str) -> bool:
        # A request's first load breaks, not every one (it would never finish).
        if req_id in failing and req_id not in already_failed:
            already_failed.add(req_id)
            return True
        return False

    windows = None if w.layout is None else w.layout.sliding_windows
    return scheduler, OracleRunner(draft_fn=drafter, fail_load=fail_load, sliding_windows=windows)


def _new_request(r: dict, w: Workload, now: float):
    params: dict[str, Any] = {"ignore_eos": True}
    if r["n"] > 1:
        params["n"] = r["n"]
    if w.structured and r["grammar"]:
        params["structured_outputs"] = StructuredOutputParams(regex="[a-z]+")
    request = new_request(r["id"], r["prompt"], max_tokens=r["max_tokens"], priority=r["priority"],
                          arrival_time=now, **params)
    request.tenant = r["tenant"]
    if w.scheduler["policy"] == "slo":
        request.slo_ttft_s = r["ttft"]
    return request


def run_workload(w: Workload, max_steps: int = 3000) -> OracleRun:
    """Step the workload to the end (one step in flight with async scheduling)."""
    now = [0.0]
    scheduler, runner = build(w, lambda: now[0])
    pending = sorted(w.requests, key=lambda r: r["arrival_step"])
    run = OracleRun()
    in_flight = None
    for step_index in range(max_steps):
        now[0] = step_index * 0.01
        while pending and pending[0]["arrival_step"] <= step_index:
            scheduler.add_request(_new_request(pending.pop(0), w, now[0]))
        for r in w.requests:
            if r["abort_step"] == step_index and r["id"] in scheduler.requests:
                scheduler.finish_requests(r["id"], RequestStatus.FINISHED_ABORTED)
                run.aborted.add(r["id"])
        if w.structured:
            scheduler.structured_output_manager.tick()
        next_step = None
        if scheduler.has_requests():
            so = scheduler.schedule()
            assert so.total_num_scheduled_tokens <= w.scheduler["max_num_batched_tokens"]
            assert len(scheduler.running) <= w.scheduler["max_num_seqs"]
            run.num_preemptions += len(so.preempted_req_ids)
            next_step = (so, runner.execute(so))
            if not w.async_scheduling:
                _absorb(scheduler, next_step, run)
                next_step = None
        if in_flight is not None:
            _absorb(scheduler, in_flight, run)
        in_flight = next_step
        if in_flight is None and not pending and not scheduler.has_requests():
            break
    else:
        raise AssertionError(f"requests left after {max_steps} steps: {list(scheduler.requests)}")
    _check_end(scheduler)
    run.num_steps = step_index
    run.num_swaps = scheduler.num_swapped_preemptions_total
    run.num_failed_loads = runner.num_failed_loads
    run.num_reads_checked = runner.shadow_kv.num_reads_checked
    scheduler.shutdown()
    return run


def _absorb(scheduler, step, run: OracleRun) -> None:
    so, output = step
    for out in flatten(scheduler.update_from_output(so, output)):
        run.streams.setdefault(out.request_id, []).extend(out.new_token_ids)
    scheduler.kv_cache_manager.check_consistency()


def _check_end(scheduler) -> None:
    kv = scheduler.kv_cache_manager
    assert not kv.req_to_blocks and not scheduler.requests, "requests or blocks left"
    assert kv.num_free_blocks + kv.num_reserved_blocks == kv.block_pool.num_blocks, "blocks leaked"
    if isinstance(scheduler.connector, OffloadingConnector):
        scheduler.connector.tier.check_consistency()


def expected_streams(w: Workload, run: OracleRun) -> None:
    """Every stream is the greedy one (an aborted one: a prefix of it)."""
    for r in w.requests:
        expected = greedy_stream(r["prompt"], r["max_tokens"])
        ids = [r["id"]] if r["n"] == 1 else [f"{i}_{r['id']}" for i in range(r["n"])]
        for req_id in ids:
            got = run.streams.get(req_id, [])
            if r["id"] in run.aborted:
                assert got == expected[: len(got)], req_id
            else:
                assert got == expected, (req_id, got, expected)


# ----------------------------------------------------------------------
# Prefill/decode disaggregation: a producer and a consumer scheduler
# ----------------------------------------------------------------------


class PDWorkers:
    """The worker sides of a producer and a consumer, on their shadow caches:
    a consumer's load copies the producer's held blocks into its own (or
    garbage, reported invalid, when the load breaks), and the producer hears
    that its blocks were pulled in its next step."""

    def __init__(self, producer: OracleRunner, consumer: OracleRunner, fail_load) -> None:
        self.producer, self.consumer = producer, consumer
        self.fail_load = fail_load
        self.pulled: set[str] = set()  # producer requests whose blocks were pulled
        producer.connector_hook = self._producer_step
        consumer.connector_hook = self._consumer_step

    def _producer_step(self, meta) -> KVConnectorOutput | None:
        pulled, self.pulled = self.pulled, set()
        return KVConnectorOutput(finished_sending=pulled) if pulled else None

    def _consumer_step(self, meta) -> KVConnectorOutput | None:
        received, invalid = set(), set()
        for load in meta.loads:
            self.pulled.add(load.remote_request_id)
            if not load.local_block_ids:
                continue  # only telling the producer to let go
            fails = self.fail_load(load.req_id)
            for i, (local, remote) in enumerate(zip(load.local_block_ids, load.remote_block_ids)):
                if fails and i == len(load.local_block_ids) // 2:
                    invalid.add(local)
                    self.consumer.num_failed_loads += 1
                    self.consumer._fill(local, {o: GARBAGE for o in range(BLOCK_SIZE)})
                else:
                    self.consumer._fill(local, self.producer._block(remote))
            received.add(load.req_id)
        if not received:
            return None
        return KVConnectorOutput(finished_recving=received, invalid_block_ids=invalid or None)


def _pd_scheduler(w: Workload, role: str, clock):
    context = KVConnectorContext(block_size=BLOCK_SIZE, num_blocks=w.scheduler["num_gpu_blocks"],
                                 bytes_per_block=BYTES_PER_BLOCK, kv_role=role)
    connector = PDConnectorScheduler(
        KVTransferConfig(kv_connector="PDConnector", kv_role=role), context)
    spec = SpeculativeConfig(num_speculative_tokens=w.num_spec) if w.num_spec else None
    manager = SteppedGrammarManager(w.grammar_delay) if w.structured else None
    return new_scheduler(
        block_size=BLOCK_SIZE, max_model_len=256, log_stats=True, clock=clock,
        speculative_config=spec if role == CONSUMER else None, kv_connector=connector,
        structured_output_manager=manager, kv_cache_layout=w.layout, **w.scheduler)


def run_pd_workload(w: Workload, max_steps: int = 3000) -> OracleRun:
    """Each request prefills on a producer (one token, blocks held), then runs
    whole on a consumer that pulls the prompt's KV: both schedulers step side
    by side, each with its own shadow cache."""
    now = [0.0]
    producer = _pd_scheduler(w, PRODUCER, lambda: now[0])
    consumer = _pd_scheduler(w, CONSUMER, lambda: now[0])
    failed: set[str] = set()

    def fail_load(req_id: str) -> bool:
        if req_id in w.failing_loads and req_id not in failed:
            failed.add(req_id)
            return True
        return False

    drafter = make_drafter(w.num_spec, w.draft_accuracy) if w.num_spec else None
    windows = None if w.layout is None else w.layout.sliding_windows
    p_runner = OracleRunner(sliding_windows=windows)
    c_runner = OracleRunner(draft_fn=drafter, sliding_windows=windows)
    PDWorkers(p_runner, c_runner, fail_load)
    by_id = {r["id"]: r for r in w.requests}
    pending = sorted(w.requests, key=lambda r: r["arrival_step"])
    run, handed = OracleRun(), []
    for step_index in range(max_steps):
        now[0] = step_index * 0.01
        while pending and pending[0]["arrival_step"] <= step_index:
            r = pending.pop(0)
            request = _new_request(dict(r, max_tokens=1, n=1), w, now[0])
            request.kv_transfer_params = {"do_remote_decode": True}
            producer.add_request(request)
        while handed:
            r, params = handed.pop(0)
            request = _new_request(r, w, now[0])
            request.kv_transfer_params = params
            consumer.add_request(request)
        for r in w.requests:
            if r["abort_step"] == step_index and r["id"] in consumer.requests:
                consumer.finish_requests(r["id"], RequestStatus.FINISHED_ABORTED)
                run.aborted.add(r["id"])
        for scheduler, runner, is_producer in ((producer, p_runner, True), (consumer, c_runner, False)):
            if w.structured:
                scheduler.structured_output_manager.tick()
            if not scheduler.has_requests():
                continue
            so = scheduler.schedule()
            run.num_preemptions += len(so.preempted_req_ids)
            output = runner.execute(so)
            for out in flatten(scheduler.update_from_output(so, output)):
                if is_producer:
                    if out.kv_transfer_params is not None:
                        handed.append((by_id[out.request_id], out.kv_transfer_params))
                    elif out.finish_reason is not None and out.request_id not in run.aborted:
                        handed.append((by_id[out.request_id], None))  # nothing held: computed there
                else:
                    run.streams.setdefault(out.request_id, []).extend(out.new_token_ids)
            scheduler.kv_cache_manager.check_consistency()
        if not pending and not handed and not producer.has_requests() and not consumer.has_requests():
            break
    else:
        raise AssertionError(f"requests left after {max_steps} steps: producer "
                             f"{list(producer.requests)}, consumer {list(consumer.requests)}")
    for scheduler in (producer, consumer):
        _check_end(scheduler)
        scheduler.shutdown()
    run.num_steps = step_index
    run.num_failed_loads = c_runner.num_failed_loads
    run.num_reads_checked = p_runner.shadow_kv.num_reads_checked + c_runner.shadow_kv.num_reads_checked
    return run


def pd_workload(w: Workload) -> Workload:
    """``w`` as P/D runs it: no host tier (one connector per engine), no async
    scheduling (the P/D driver steps both engines in turn); its KV cache groups
    on both engines."""
    scheduler = {k: v for k, v in w.scheduler.items() if k != "async_scheduling"}
    return dataclasses.replace(w, scheduler=scheduler, tier_slots=0, preemption_mode="recompute")
