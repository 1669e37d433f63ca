"""Prefill/decode disaggregation on the virtual clock: prefill replicas and
decode replicas, the prompt's KV pulled over a link between them.

Every replica is a whole ``Simulator`` whose scheduler has the real
``PDConnectorScheduler`` (``kv_producer`` on a prefill replica,
``kv_consumer`` on a decode one); only its worker side is simulated
(``PulledKV``). A request goes the way ``cadence proxy`` sends it:

    arrival at t0     a prefill replica (the prefill pool's router) gets it with
                      max_tokens=1 and {"do_remote_decode": true}
    its step ends t1  the prefill's token is dropped, as the proxy drops it; the
                      connector holds the prompt's blocks and returns the
                      kv_transfer_params; a decode replica gets the request
                      with them and the whole max_tokens
    decode schedules  get_num_new_matched_tokens: the prompt is external, loaded
                      asynchronously; blocks are allocated, the request waits
                      in WAITING_FOR_REMOTE_KVS; the step's metadata starts the
                      pull at the step's start
    the pull ends     start + bytes / bandwidth (+ latency): the decode replica's
                      next step reports it received (finished_recving), the
                      prefill replica's reports it sent (finished_sending: its
                      blocks are freed); the decode replica computes the last
                      prompt token (as the real consumer does) and samples the
                      first output token: the request's first token (TTFT)

A pull moves the prompt tokens the decode replica does not hold already
(all of them without a prefix hit there), at the model's KV bytes per token,
the figure the KV tier uses. Each (prefill, decode) pair has one link of the
named kind; pulls on it go one at a time, in the order they start. The
optional ``transfer_latency_s`` is added to each pull's end without keeping
the link busy (none by default). At equal times a step's end comes before a
pull's end, and both before an arrival. A replica whose step computed
nothing and reported no finished pull waits for the next event.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from cadence.config import CacheConfig, KVTransferConfig, SchedulerConfig
from cadence.core.kv_transfer.pd_connector import CONSUMER, PRODUCER, PDConnectorMetadata, RemoteBlocks
from cadence.core.outputs import KVConnectorOutput
from cadence.core.sched.kv_connector import KVConnectorContext
from cadence.core.sched.policy import AdmissionRefused
from cadence.engine.dp_router import DPRouter
from cadence.engine.kv_connectors import make_kv_connector_scheduler
from cadence.sampling_params import SamplingParams
from cadence.sim.conversations import refuse_later_turns
from cadence.sim.cost_model import CostModel
from cadence.sim.kv_tier import COPY_LINKS
from cadence.sim.metrics import SLO, MetricsRecorder
from cadence.sim.replicas import CollectedEvents, Replica, ReplicaFleet, record_queues
from cadence.sim.simulator import RequestFactory, SimResult, Simulator, SimulationStalled, _gc_paused
from cadence.sim.workload import PromptMaker, RequestSpec

# Bytes per second, one direction, between a prefill and a decode GPU: pcie
# and nvlink as the KV tier prices them (an H100's NVLink 4 moves 450 GB/s
# each way, NVLink-C2C's figure too); the network links at their line rate.
TRANSFER_LINKS = {**COPY_LINKS, "ethernet-100g": 12.5e9, "rdma-400g": 50e9}

_STEP_END, _PULL_END, _ARRIVAL = 0, 1, 2  # the order of events at equal times
_FIRST_KV_PORT = 14579  # prefill replica k serves its blocks on this port + k
# What the proxy sends a prefill replica: one token, and hold the prompt's KV.
_PREFILL_PARAMS = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0,
                                 extra_args={"kv_transfer_params": {"do_remote_decode": True}})


def link_bytes_per_second(link: str) -> float:
    """The named link's bandwidth (ValueError naming pd_link for an unknown one)."""
    if link not in TRANSFER_LINKS:
        raise ValueError(f"pd_link: must be one of {', '.join(TRANSFER_LINKS)}, got {link!r}")
    return TRANSFER_LINKS[link]


class PulledKV:
    """The PDConnector's worker side on a simulated replica: the pulls a step
    starts go to the fleet, which prices them on its links and says when each
    ends; a step reports the pulls that ended by its end (the real worker
    reports what finished during a step when the step ends). Pulls run beside
    the steps: they cost a step nothing."""

    def __init__(self) -> None:
        self.now: Callable[[], float] = lambda: 0.0  # the replica's clock: a step's start
        self.started: list[RemoteBlocks] = []
        self._ends: list[tuple[float, bool, str]] = []  # (when, received?, req_id), a heap
        # Per step executed and not yet absorbed (in order): whether it reports a pull.
        self.reports: deque[bool] = deque()

    def add_end(self, when: float, req_id: str, *, received: bool) -> None:
        """The pull of ``req_id`` ends ``when``: received here, or sent from here."""
        heapq.heappush(self._ends, (when, received, req_id))

    def charge(self, metadata: PDConnectorMetadata | None,
               forward_seconds: float) -> tuple[float, float, KVConnectorOutput | None]:
        if metadata is not None and metadata.loads:
            self.started.extend(metadata.loads)
        step_end, ends = self.now() + forward_seconds, self._ends
        recving: dict[str, None] = {}
        sending: dict[str, None] = {}
        while ends and ends[0][0] <= step_end:
            _, received, req_id = heapq.heappop(ends)
            (recving if received else sending)[req_id] = None
        self.reports.append(bool(recving or sending))
        if not (recving or sending):
            return 0.0, 0.0, None
        # Sets in the order the pulls ended (a dict's keys): the scheduler admits
        # loaded requests in that order, whatever the process's string hash seed.
        return 0.0, 0.0, KVConnectorOutput(finished_sending=sending.keys() or None,
                                           finished_recving=recving.keys() or None)

    def take_started(self) -> list[RemoteBlocks]:
        started, self.started = self.started, []
        return started


class PDReplica(Replica):
    """A replica of either pool; it waits for an event after a step that did nothing."""

    def __init__(self, simulator: Simulator, publisher: CollectedEvents | None, pulls: PulledKV) -> None:
        super().__init__(simulator, publisher)
        self.pulls = pulls

    def step(self, now: float) -> tuple[float, Any, list]:
        result = super().step(now)
        last, reports = self.clock.last_step, self.pulls.reports
        absorbed_report = reports.popleft() if reports else False  # one step absorbed per call
        # A held prompt alone keeps the engine stepping (its blocks are not sent):
        # nothing changes until a pull ends, an arrival, or a step's results.
        pending = any(reports) or any(out.total_num_scheduled_tokens for out, _ in self.core.in_flight)
        self.stalled = not (last.shape.num_tokens or last.num_preempted or absorbed_report or pending)
        return result


@dataclass
class PDResult(SimResult):
    """A P/D run: the serving metrics and the link's totals."""

    num_transfers: int = 0
    transfer_bytes: int = 0
    transfer_s: float = 0.0  # the seconds pulls took on their links, summed
    link_wait_s: float = 0.0  # the seconds pulls waited for a busy link, summed

    def summary(self, slo: SLO = SLO(), client_weights: dict[int, float] | None = None) -> dict[str, Any]:
        result = super().summary(slo, client_weights)
        result["transfers"] = {"count": self.num_transfers, "bytes": self.transfer_bytes,
                               "seconds": self.transfer_s, "link_wait_s": self.link_wait_s}
        return result


class PDFleet:
    """``num_prefill`` prefill and ``num_decode`` decode replicas joined by ``link`` (module docstring)."""

    def __init__(self, num_prefill: int, num_decode: int, link: str, scheduler_config: SchedulerConfig,
                 cache_config: CacheConfig, cost_model: CostModel, *, routing: str = "least_loaded",
                 transfer_latency_s: float = 0.0, load_margin_tokens: int = 8192,
                 prompt_maker: PromptMaker | None = None, charge_host_time: bool = False) -> None:
        for name, value in (("num_prefill", num_prefill), ("num_decode", num_decode)):
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        self.bytes_per_second = link_bytes_per_second(link)
        if not transfer_latency_s >= 0:
            raise ValueError(f"transfer_latency_s: must be >= 0, got {transfer_latency_s!r}")
        if hasattr(cost_model, "with_kv_cache"):  # the cache's width, and its groups
            cost_model = cost_model.with_kv_cache(cache_config.kv_cache_dtype, cache_config.kv_cache_groups)
        kv_bytes_per_token = getattr(cost_model, "kv_bytes_per_token", None)
        if kv_bytes_per_token is None:
            raise ValueError("pd_link: pricing the pulls needs a roofline cost model "
                             "(it reads the KV bytes per token from the model's shape)")
        self.link = link
        self.transfer_latency_s = transfer_latency_s
        self.kv_bytes_per_token = kv_bytes_per_token
        # With KV cache groups a pull moves pages of one group's layers each (None: one group).
        layout = cost_model.kv_cache_layout() if hasattr(cost_model, "kv_cache_layout") else None
        self.page_bytes = None if layout is None else cost_model.kv_block_bytes(cache_config.block_size)
        self.routing = routing
        if routing == "cache_aware":  # the routers learn what each replica caches from its events
            cache_config = replace(cache_config, enable_kv_cache_events=True)
        make = self._replica_maker(scheduler_config, cache_config, cost_model, charge_host_time)
        self.prefills = [make(PRODUCER, rank) for rank in range(num_prefill)]
        self.decodes = [make(CONSUMER, rank) for rank in range(num_decode)]
        self.block_size = cache_config.block_size
        self.prefill_router, self.decode_router = (
            DPRouter(n, routing, block_size=self.block_size, load_margin_tokens=load_margin_tokens)
            for n in (num_prefill, num_decode))
        self.factory = RequestFactory(prompt_maker or PromptMaker(), scheduler_config.max_model_len)
        self._events: list[tuple] = []  # (time, kind, seq, payload), a heap
        self._seq = itertools.count()
        self._link_free_at: dict[tuple[int, int], float] = {}  # (prefill, decode rank) -> when
        self._prompts: dict[int, list[int]] = {}  # request index -> prompt, until it reaches decode
        self._num_cached_at_prefill: dict[int, int] = {}
        self._reset_totals()

    def _replica_maker(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                       cost_model: CostModel, charge_host_time: bool):
        cache_aware = self.routing == "cache_aware"

        def make(role: str, rank: int) -> PDReplica:
            pulls = PulledKV()
            config = KVTransferConfig(kv_connector="PDConnector", kv_role=role, kv_connector_extra_config={
                "kv_port": _FIRST_KV_PORT + rank, "engine_id": f"{role}-{rank}"})

            def connector(cache: CacheConfig):
                context = KVConnectorContext(
                    block_size=cache.block_size, num_blocks=cache.num_gpu_blocks,
                    bytes_per_block=int(self.page_bytes or cache.block_size * self.kv_bytes_per_token),
                    kv_role=role)
                return make_kv_connector_scheduler(config, context), pulls

            simulator = Simulator(scheduler_config, cache_config, cost_model,
                                  charge_host_time=charge_host_time, kv_connector=connector)
            clock = simulator.clock
            pulls.now = lambda: clock.now
            return PDReplica(simulator, CollectedEvents() if cache_aware else None, pulls)
        return make

    def _reset_totals(self) -> None:
        self.num_transfers = self.transfer_bytes = 0
        self.transfer_seconds = self.link_wait_seconds = 0.0

    # ------------------------------------------------------------ the run

    def run(self, specs: Sequence[RequestSpec], label: str | None = None) -> PDResult:
        refuse_later_turns(specs, "prefill_decode")
        recorder = MetricsRecorder(specs)
        start = time.perf_counter()
        self._reset_totals()
        for index, spec in enumerate(specs):
            self._push(spec.arrival_time, _ARRIVAL, index)
        with _gc_paused():
            while self._events:
                now, kind, _, payload = heapq.heappop(self._events)
                if kind == _ARRIVAL:
                    self._arrive(now, payload, specs, recorder)
                elif kind == _PULL_END:
                    self._end_pull(now, *payload)
                else:
                    self._end_step(now, *payload, specs, recorder)
        self._check_all_done()
        # Prefix hits are the prefill's: the decode replica counts the pulled prompt as cached.
        for index, num_cached in self._num_cached_at_prefill.items():
            recorder.num_cached[index] = num_cached
        simulators = [replica.simulator for replica in self.replicas]
        return PDResult(
            label=label or f"pd {len(self.prefills)}P{len(self.decodes)}D {self.link}",
            recorder=recorder, num_steps=sum(replica.num_steps for replica in self.replicas),
            num_preemptions=sum(s.scheduler.num_preemptions_total for s in simulators),
            clock_s=max(s.clock.now for s in simulators),
            busy_s=sum(s.clock.busy_seconds for s in simulators),
            wall_s=time.perf_counter() - start,
            num_transfers=self.num_transfers, transfer_bytes=self.transfer_bytes,
            transfer_s=self.transfer_seconds, link_wait_s=self.link_wait_seconds)

    @property
    def replicas(self) -> list[PDReplica]:
        return self.prefills + self.decodes

    def _push(self, when: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._events, (when, kind, next(self._seq), payload))

    # ------------------------------------------------------------ prefill side

    def fits(self, spec: RequestSpec) -> bool:
        """Whether a prefill replica holds the prompt and a decode replica the
        prompt and all the output (a request that could never run is refused)."""
        if not self.factory.fits(spec):
            return False
        prefill_blocks = min(r.simulator.cache_config.num_gpu_blocks for r in self.prefills)
        decode_blocks = min(r.simulator.cache_config.num_gpu_blocks for r in self.decodes)
        return (math.ceil((spec.prompt_tokens + 1) / self.block_size) <= prefill_blocks
                and math.ceil((spec.prompt_tokens + spec.output_tokens) / self.block_size) <= decode_blocks)

    def _arrive(self, now: float, index: int, specs: Sequence[RequestSpec], recorder: MetricsRecorder) -> None:
        spec = specs[index]
        if not self.fits(spec):
            recorder.on_reject(index)
            return
        prompt = self.factory.prompt_maker.make(index, spec)
        request = self.factory.make(index, spec, prompt_token_ids=prompt, params=_PREFILL_PARAMS)
        rank = self.prefill_router.route(request.request_id, prompt, 1)
        try:
            self.prefills[rank].core.add_request(request)
        except AdmissionRefused:  # the policy refused it at this load (e.g. slo with slo_reject)
            self.prefill_router.release(request.request_id)
            recorder.on_reject(index)
            return
        self._prompts[index] = prompt
        recorder.on_arrival(index, request.request_id, spec.arrival_time)
        self._wake(self.prefills, rank, now)

    def _prefilled(self, now: float, outputs: Any, specs: Sequence[RequestSpec],
                   recorder: MetricsRecorder) -> None:
        """A prefill step's finished requests go on to a decode replica (their
        one token is not delivered)."""
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                if out.finish_reason is None:
                    continue
                self.prefill_router.release(out.request_id)
                index = int(out.request_id)
                self._num_cached_at_prefill[index] = out.num_cached_tokens
                if not self._send_to_decode(now, index, specs[index], out.kv_transfer_params):
                    recorder.on_reject(index)

    def _send_to_decode(self, now: float, index: int, spec: RequestSpec, kv_transfer_params: dict | None) -> bool:
        """False when the decode replica refuses it (slo_reject): the prefill
        replica then frees the prompt it holds."""
        prompt = self._prompts.pop(index)
        extra_args = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
        params = SamplingParams(max_tokens=spec.output_tokens, ignore_eos=True, temperature=0.0,
                                extra_args=extra_args)
        request = self.factory.make(index, spec, prompt_token_ids=prompt, params=params)
        rank = self.decode_router.route(request.request_id, prompt, spec.output_tokens)
        try:
            self.decodes[rank].core.add_request(request)
        except AdmissionRefused:
            self.decode_router.release(request.request_id)
            if kv_transfer_params:
                self._release_hold(now, kv_transfer_params["remote_port"] - _FIRST_KV_PORT,
                                   kv_transfer_params["remote_request_id"])
            return False
        self._wake(self.decodes, rank, now)
        return True

    # ------------------------------------------------------------ steps

    def _wake(self, pool: list[PDReplica], rank: int, now: float) -> None:
        pool[rank].stalled = False
        self._start_step(pool, rank, now)

    def _start_step(self, pool: list[PDReplica], rank: int, now: float) -> None:
        replica = pool[rank]
        if not replica.can_step():
            return
        end, outputs, events = replica.step(now)
        self._push(end, _STEP_END, (pool is self.decodes, rank, outputs, events))
        for load in replica.pulls.take_started():  # pulls start with the step
            self._start_pull(now, rank, load)

    def _end_step(self, now: float, is_decode: bool, rank: int, outputs: Any, events: list,
                  specs: Sequence[RequestSpec], recorder: MetricsRecorder) -> None:
        pool, router = (self.decodes, self.decode_router) if is_decode else (self.prefills, self.prefill_router)
        pool[rank].stepping = False
        if outputs:
            if is_decode:
                recorder.on_step(now, outputs)
                for engine_outputs in outputs.values():
                    for out in engine_outputs.outputs:
                        if out.finish_reason is not None:
                            router.release(out.request_id)
            else:
                self._prefilled(now, outputs, specs, recorder)
        if events:
            router.absorb_kv_events(rank, events)
        record_queues(self.replicas, now, recorder)  # both pools
        self._start_step(pool, rank, now)

    # ------------------------------------------------------------ pulls

    def _start_pull(self, now: float, decode_rank: int, load: RemoteBlocks) -> None:
        """A decode replica's pull of ``load`` starts now, once its link is free."""
        prefill_rank = int(load.remote_address.rsplit(":", 1)[1]) - _FIRST_KV_PORT
        if not load.local_block_ids:  # nothing to pull: the prefill replica may free its blocks
            self._release_hold(now, prefill_rank, load.remote_request_id)
            return
        prompt_tokens = self.decodes[decode_rank].core.scheduler.get_request(load.req_id).num_prompt_tokens
        if self.page_bytes is not None:  # every group's pages (a window group's window only)
            num_bytes = len(load.local_block_ids) * self.page_bytes
        else:
            first_block = math.ceil(prompt_tokens / self.block_size) - len(load.local_block_ids)
            num_bytes = (prompt_tokens - first_block * self.block_size) * self.kv_bytes_per_token
        seconds = num_bytes / self.bytes_per_second
        pair = (prefill_rank, decode_rank)
        begin = max(now, self._link_free_at.get(pair, 0.0))
        self._link_free_at[pair] = begin + seconds
        self.num_transfers += 1
        self.transfer_bytes += num_bytes
        self.transfer_seconds += seconds
        self.link_wait_seconds += begin - now
        end = begin + seconds + self.transfer_latency_s
        self.prefills[prefill_rank].pulls.add_end(end, load.remote_request_id, received=False)
        self.decodes[decode_rank].pulls.add_end(end, load.req_id, received=True)
        self._push(end, _PULL_END, (prefill_rank, decode_rank))

    def _release_hold(self, now: float, prefill_rank: int, prefill_req_id: str) -> None:
        """The prefill replica frees a prompt it holds, nothing pulled."""
        self.prefills[prefill_rank].pulls.add_end(now, prefill_req_id, received=False)
        self._push(now, _PULL_END, (prefill_rank, None))

    def _end_pull(self, now: float, prefill_rank: int, decode_rank: int | None) -> None:
        """A pull ended: a side that waits steps to report it (a side that
        steps reports it at that step's end)."""
        self._wake(self.prefills, prefill_rank, now)
        if decode_rank is not None:
            self._wake(self.decodes, decode_rank, now)

    def _check_all_done(self) -> None:
        stuck = sum(r.core.scheduler.get_num_unfinished_requests() for r in self.replicas)
        held = sum(r.core.scheduler.num_sending_requests() for r in self.prefills)
        if stuck or held:
            raise SimulationStalled(f"{stuck} requests can never be scheduled, {held} prompts "
                                    "are held for a pull that never came")


def compare_pd(specs: Sequence[RequestSpec], num_prefill: int, num_decode: int, links: Sequence[str],
               scheduler_config: SchedulerConfig, cache_config: CacheConfig, cost_model: CostModel, *,
               routing: str = "least_loaded", transfer_latency_s: float = 0.0,
               load_margin_tokens: int = 8192, charge_host_time: bool = False) -> dict[str, SimResult]:
    """The same specs on ``num_prefill + num_decode`` data-parallel replicas (the
    same GPUs, no disaggregation), then on the P/D fleet over each link."""
    for link in links:
        link_bytes_per_second(link)  # a bad name fails before any run
    num_replicas = num_prefill + num_decode
    results: dict[str, SimResult] = {}
    label = f"dp {num_replicas}"
    results[label] = ReplicaFleet(num_replicas, routing, scheduler_config, cache_config, cost_model,
                                  load_margin_tokens=load_margin_tokens,
                                  charge_host_time=charge_host_time).run(specs, label=label)
    for link in links:
        fleet = PDFleet(num_prefill, num_decode, link, scheduler_config, cache_config, cost_model,
                        routing=routing, transfer_latency_s=transfer_latency_s,
                        load_margin_tokens=load_margin_tokens, charge_host_time=charge_host_time)
        result = fleet.run(specs)
        results[result.label] = result
    return results
