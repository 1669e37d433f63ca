"""``DPAsyncLLM``: several engine-core replicas behind one front end (data parallelism).

    HTTP handlers ──add_request──► DPAsyncLLM ──route──► ReplicaClient 0 ──ZMQ──► engine core 0
                                     │  DPRouter            ReplicaClient 1 ──ZMQ──► engine core 1
                                     │                      ...
                                     └──◄── ZMQ SUB ◄── KV-cache events of every replica (cache_aware)

Each replica is a full ``AsyncLLM`` (its own sockets, output processor and
request queues) whose engine runs in a local process (``mp``) or in a Ray
actor placed by Ray on a node of its cluster (``ray``, ``cadence.engine.ray_replicas``).
The router (``cadence.engine.dp_router``) picks the replica of each request
and is told when the request ends; with ``cache_aware`` routing every
replica publishes its KV-cache events (stamped with its
``data_parallel_rank``) to one SUB socket the front end binds.

A replica that dies fails its own requests at once (``EngineDeadError``), is
routed nothing more and shows in ``replica_health()`` (``/health``,
``/metrics``); the others keep serving. The front end is dead only when every
replica is.

With ``data_parallel_size`` 1 and no Ray, the server uses ``AsyncLLM`` itself
(``make_async_llm``): the single-engine path pays nothing for this module.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Callable

import msgspec
import zmq
import zmq.asyncio

from cadence.config import EngineOptions
from cadence.core.outputs import SchedulerStats
from cadence.core.request import LoRARequest, extra_hash_key_of
from cadence.engine.async_llm import (
    AsyncLLM, EngineDeadError, FrontendState, RequestStream, StatLogger,
)
from cadence.engine.core_proc import start_engine_process
from cadence.engine.dp_router import DPRouter
from cadence.engine.kv_events import KVEventBatch
from cadence.engine.wire import EngineReady
from cadence.sampling_params import SamplingParams

logger = logging.getLogger("cadence.dp")


def uses_replicas(options: EngineOptions) -> bool:
    """Whether a server runs ``DPAsyncLLM`` (several replicas, or engines on Ray)."""
    parallel = options.parallel
    return parallel.data_parallel_size > 1 or parallel.distributed_executor_backend == "ray"


def make_async_llm(options: EngineOptions, *, stat_logger: StatLogger | None = None,
                   max_num_queued_requests: int | None = None) -> AsyncLLM | "DPAsyncLLM":
    if not uses_replicas(options):
        return AsyncLLM(stat_logger=stat_logger, max_num_queued_requests=max_num_queued_requests)
    return DPAsyncLLM(options, stat_logger=stat_logger,
                      max_num_queued_requests=max_num_queued_requests)


def check_dp_options(options: EngineOptions) -> None:
    """Refuse (ValueError naming it) what data parallelism cannot deliver yet."""
    if options.parallel.tensor_parallel_size > 1:
        raise ValueError("tensor_parallel_size: not supported together with data_parallel_size "
                         "> 1 or distributed_executor_backend ray yet (each replica runs the "
                         "whole model in one process)")
    device = options.engine.device
    if options.parallel.distributed_executor_backend == "ray" and device.startswith("cuda:"):
        raise ValueError(f"device: {device!r} names one GPU, but with distributed_executor_backend "
                         "ray, Ray gives each replica its own GPU; give cuda (or auto)")
    if options.parallel.data_parallel_size > 1 and options.cache.enable_kv_cache_events:
        raise ValueError("enable_kv_cache_events: not supported with data_parallel_size > 1 yet "
                         "(the front end subscribes to the replicas' events itself, for "
                         "--dp-routing cache_aware)")
    if options.kv_transfer is not None:
        raise ValueError("kv_transfer_config: a KV connector (host tier, P/D) is not supported "
                         "with data_parallel_size > 1 or distributed_executor_backend ray yet")


def local_replica_options(options: EngineOptions, rank: int) -> EngineOptions:
    """A local replica's options: with ``device`` cuda, replica ``rank`` gets GPU
    ``rank`` (on Ray, Ray gives each actor its GPU instead)."""
    if options.engine.device != "cuda" or options.parallel.data_parallel_size == 1:
        return options
    return dataclasses.replace(options, engine=dataclasses.replace(options.engine,
                                                                   device=f"cuda:{rank}"))


# ---------------------------------------------------------------- one replica


class ReplicaClient(AsyncLLM):
    """An ``AsyncLLM`` for replica ``rank``: tells the router when its requests
    end and when its engine dies; its engine is spawned by ``spawn``."""

    def __init__(self, rank: int, spawn: Callable[["ReplicaClient", EngineOptions, str], Any], *,
                 on_forget: Callable[[str], None], on_dead: Callable[[int], None],
                 tcp_host: str | None, **kwargs: Any) -> None:
        super().__init__(tcp_host=tcp_host, **kwargs)
        self.rank = rank
        self._spawn = spawn
        self._on_forget = on_forget
        self._on_dead = on_dead
        self.death: str | None = None  # why it died, for /health

    def _spawn_engine(self, options: EngineOptions, model_name: str) -> Any:
        return self._spawn(self, options, model_name)

    def _forget(self, request_id: str) -> None:
        super()._forget(request_id)
        self._on_forget(request_id)

    def _mark_dead(self, message: str) -> None:
        if self._dead is None:
            actor_error = getattr(self.process, "error", None)  # a Ray actor's, say ActorDiedError
            if actor_error:
                message = f"the engine actor died: {actor_error}"
            self.death = message
            super()._mark_dead(f"replica {self.rank}: {message}")
            self._on_dead(self.rank)


class ReplicaStatLogger:
    """One replica's ``StatLogger``: request records go straight through; the
    scheduler's gauges (running, waiting, KV usage) are summed over replicas."""

    def __init__(self, target: StatLogger, latest: list[SchedulerStats], rank: int) -> None:
        self._target = target
        self._latest = latest  # shared by every replica's logger
        self._rank = rank

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        latest = self._latest
        latest[self._rank] = stats
        self._target.record_scheduler_stats(msgspec.structs.replace(
            stats, num_running_reqs=sum(s.num_running_reqs for s in latest),
            num_waiting_reqs=sum(s.num_waiting_reqs for s in latest),
            kv_cache_usage=sum(s.kv_cache_usage for s in latest) / len(latest)))

    def watch_frontend(self, read: Callable[[], FrontendState]) -> None:
        pass  # DPAsyncLLM reports the sum over replicas

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


# ---------------------------------------------------------------- the front end


class DPAsyncLLM:
    """``AsyncLLM``'s interface over ``data_parallel_size`` replicas (see the module docstring)."""

    def __init__(self, options: EngineOptions, *, stat_logger: StatLogger | None = None,
                 max_num_queued_requests: int | None = None) -> None:
        check_dp_options(options)
        parallel, router = options.parallel, options.router
        self.backend = parallel.distributed_executor_backend or "mp"
        num_replicas = parallel.data_parallel_size
        self.router = DPRouter(num_replicas, router.dp_routing, block_size=options.cache.block_size,
                               load_margin_tokens=router.dp_load_margin_tokens)
        self._ray = None
        tcp_host = None
        if self.backend == "ray":
            from cadence.engine.ray_replicas import RayEngines

            self._ray = RayEngines(options)
            tcp_host = self._ray.node_ip
        self._tcp_host = tcp_host or "127.0.0.1"
        self.stat_logger = stat_logger
        latest = [SchedulerStats() for _ in range(num_replicas)]
        self.replicas = [
            ReplicaClient(
                rank, self._spawn, on_forget=self.router.release, on_dead=self._replica_died,
                tcp_host=tcp_host, max_num_queued_requests=max_num_queued_requests,
                stat_logger=None if stat_logger is None else ReplicaStatLogger(stat_logger, latest, rank))
            for rank in range(num_replicas)]
        self._events_ctx: zmq.asyncio.Context | None = None
        self._events_task: asyncio.Task | None = None
        self.events_address: str | None = None
        if stat_logger is not None:
            stat_logger.watch_frontend(self.frontend_state)
            watch = getattr(stat_logger, "watch_replicas", None)
            if watch is not None:
                watch(lambda: [replica.is_alive for replica in self.replicas])

    # ------------------------------------------------------------ start / stop

    async def start(self, options: EngineOptions, model_name: str,
                    timeout_s: float = 600.0) -> EngineReady:
        """Start every replica's engine (at once) and wait for all handshakes."""
        if self.router.policy == "cache_aware" and self.router.num_replicas > 1:
            options = self._subscribe_to_kv_events(options)
        await asyncio.gather(*(replica.start(options, model_name, timeout_s)
                               for replica in self.replicas))
        return self.info

    def _spawn(self, replica: ReplicaClient, options: EngineOptions, model_name: str) -> Any:
        if self._ray is not None:
            return self._ray.start(replica.rank, options, replica.input_address,
                                   replica.output_address, model_name)
        return start_engine_process(local_replica_options(options, replica.rank),
                                    replica.input_address, replica.output_address, model_name,
                                    dp_rank=replica.rank)

    def _subscribe_to_kv_events(self, options: EngineOptions) -> EngineOptions:
        """Bind the SUB socket the replicas publish to; their options, pointing at it."""
        self._events_ctx = zmq.asyncio.Context()
        socket = self._events_ctx.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        # Local replicas reach it on the loopback; Ray actors from any node.
        port = socket.bind_to_random_port("tcp://*" if self._ray is not None else "tcp://127.0.0.1")
        # Not a wildcard: each replica's publisher connects to it (kv_events.binds).
        self.events_address = f"tcp://{self._tcp_host}:{port}"
        self._events_task = asyncio.create_task(self._absorb_kv_events(socket),
                                                name="cadence-dp-kv-events")
        cache = dataclasses.replace(options.cache, enable_kv_cache_events=True,
                                    kv_events_endpoint=self.events_address,
                                    kv_events_replay_endpoint=None)
        return dataclasses.replace(options, cache=cache)

    async def _absorb_kv_events(self, socket: zmq.asyncio.Socket) -> None:
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        try:
            while True:
                _, _, payload = await socket.recv_multipart()
                batch = decoder.decode(payload)
                rank = batch.data_parallel_rank
                if rank is not None and 0 <= rank < self.router.num_replicas:
                    self.router.absorb_kv_events(rank, batch.events)
        except asyncio.CancelledError:
            raise
        except Exception:  # routing goes on by load alone
            logger.exception("cadence: the KV event subscriber failed; routing by load only")
        finally:
            socket.close(linger=0)

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        await asyncio.gather(*(replica.shutdown(timeout_s) for replica in self.replicas))
        if self._events_task is not None:
            self._events_task.cancel()
        if self._events_ctx is not None:
            self._events_ctx.destroy(linger=0)
        if self._ray is not None:
            await asyncio.to_thread(self._ray.shutdown)

    def _replica_died(self, rank: int) -> None:
        self.router.mark_dead(rank)
        num_alive = sum(replica.is_alive for replica in self.replicas)
        logger.error("cadence: engine replica %d died; %d of %d replicas serve on", rank,
                     num_alive, len(self.replicas))

    # ------------------------------------------------------------ state

    @property
    def live_replicas(self) -> list[ReplicaClient]:
        return [replica for replica in self.replicas if replica.is_alive]

    @property
    def is_alive(self) -> bool:
        return bool(self.live_replicas)

    @property
    def engine_process_running(self) -> bool:
        return any(replica.engine_process_running for replica in self.replicas)

    @property
    def info(self) -> EngineReady | None:
        return next((r.info for r in self.replicas if r.info is not None), None)

    @property
    def tokenizer(self):
        return next((r.tokenizer for r in self.replicas if r.tokenizer is not None), None)

    @property
    def refuses_under_load(self) -> bool:
        return self.replicas[0].refuses_under_load

    @property
    def process(self) -> Any:
        return self.replicas[0].process

    def replica_health(self) -> list[dict[str, Any]]:
        """Per replica: rank, alive, pid, requests in flight and ever routed, the
        router's load, the prefix-cache blocks its events told of, why it died."""
        router = self.router
        return [{"rank": rank, "alive": replica.is_alive, "pid": self._pid(replica),
                 "num_requests": router.num_requests[rank],
                 "num_routed_total": router.num_routed_total[rank],
                 "load_tokens": router.loads[rank],
                 "num_cached_blocks": router.index.num_held_blocks(rank),
                 **({"error": replica.death} if replica.death else {})}
                for rank, replica in enumerate(self.replicas)]

    @staticmethod
    def _pid(replica: ReplicaClient) -> int | None:
        try:
            return replica.process.pid
        except Exception:  # a Ray actor that never started
            return None

    def frontend_state(self) -> FrontendState:
        states = [replica.frontend_state() for replica in self.replicas]
        return FrontendState(**{f.name: sum(getattr(s, f.name) for s in states)
                                for f in dataclasses.fields(FrontendState)})

    # ------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    **kwargs: Any) -> RequestStream:
        """Route, then ``AsyncLLM.add_request`` on the chosen replica (same errors;
        ``EngineDeadError`` when no replica is alive)."""
        if request_id in self.router.routed:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        info = self.info
        max_model_len = info.max_model_len if info is not None else len(prompt_token_ids) + 1
        room = max(0, max_model_len - len(prompt_token_ids))
        num_output = params.n * (room if params.max_tokens is None else min(params.max_tokens, room))
        lora: LoRARequest | None = kwargs.get("lora_request")
        # The key the replicas' blocks are hashed with (adapter and cache salt), so
        # that a salted prompt goes where its own salt's blocks are, not another's.
        rank = self.router.route(request_id, prompt_token_ids, num_output,
                                 extra_key=extra_hash_key_of(lora, params.cache_salt))
        if rank is None:
            raise EngineDeadError("every engine replica is dead")
        try:
            return self.replicas[rank].add_request(request_id, prompt_token_ids, params, **kwargs)
        except BaseException:
            self.router.release(request_id)
            raise

    def abort(self, request_id: str) -> None:
        rank = self.router.rank_of(request_id)
        if rank is not None:
            self.replicas[rank].abort(request_id)

    def abort_all(self, reason: str) -> None:
        for replica in self.replicas:
            replica.abort_all(reason)

    def check_structured_outputs(self, params: SamplingParams) -> None:
        self.replicas[0].check_structured_outputs(params)

    def check_can_ever_admit(self, num_seqs: int) -> None:
        self.replicas[0].check_can_ever_admit(num_seqs)

    async def call_utility(self, method: str, *args: Any, timeout_s: float = 10.0) -> Any:
        """Run a utility on every live replica: all() of booleans, the sum of
        numbers in dicts, else the list of results."""
        live = self.live_replicas
        if not live:
            raise EngineDeadError("every engine replica is dead")
        results = await asyncio.gather(*(replica.call_utility(method, *args, timeout_s=timeout_s)
                                         for replica in live))
        return combine_results(results)

    async def add_lora(self, lora_request: LoRARequest, timeout_s: float = 120.0) -> bool:
        results = await asyncio.gather(*(replica.add_lora(lora_request, timeout_s)
                                         for replica in self.live_replicas))
        return any(results)

    async def remove_lora(self, lora_int_id: int) -> bool:
        results = await asyncio.gather(*(replica.remove_lora(lora_int_id)
                                         for replica in self.live_replicas))
        return any(results)


def combine_results(results: list[Any]) -> Any:
    if all(isinstance(result, bool) for result in results):
        return all(results)
    if all(isinstance(result, dict) for result in results):
        combined: dict[str, Any] = {}
        for result in results:
            for key, value in result.items():
                combined[key] = combined.get(key, 0) + value if isinstance(value, (int, float)) else value
        return combined
    return results
