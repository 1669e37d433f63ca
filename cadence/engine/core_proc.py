"""The engine-core process: ``build_engine`` + ``EngineCore``, driven over ZMQ.

The loop, in the spawned process:

    while running:
        drain the input socket (add / abort / finish-by-stop-string / utility),
            blocking on it while there is no work (the first idle second after
            steps hands the heap's free pages back to the kernel)
        if there is work: step once, send the EngineCoreOutputs (+ SchedulerStats)

Messages are the msgspec structs of ``cadence.engine.wire``. Nothing here
detokenizes or speaks HTTP: that is the front end's job, in another process,
so it never stalls a step. The process exits on a shutdown message, when its
parent dies, or after reporting a failed step (``EngineFailed``).
``AsyncLLM.start`` spawns it with ``start_engine_process``.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
import traceback
from typing import Any

import msgspec
import zmq

from cadence.config import EngineOptions
from cadence.core.outputs import EngineCoreOutputs, PrefixCacheStats
from cadence.core.request import LoRARequest
from cadence.core.sched.policy import AdmissionRefused
from cadence.engine import wire

_IDLE_POLL_MS = 1000  # how often an idle engine checks that its parent lives
# After a step that computed nothing (only KV transfers in flight), how long
# to wait for input before stepping again, and how often such steps report stats.
_IDLE_STEP_WAIT_MS = 5
_IDLE_STATS_INTERVAL_S = 0.05


def start_engine_process(
    options: EngineOptions, input_address: str, output_address: str, model_name: str,
    dp_rank: int | None = None,
) -> multiprocessing.process.BaseProcess:
    """Spawn the engine core (a fresh interpreter: no inherited threads or torch state);
    ``dp_rank``: its rank among data-parallel replicas (stamped on its KV events)."""
    context = multiprocessing.get_context("spawn")
    name = "cadence-engine-core" if dp_rank is None else f"cadence-engine-core-{dp_rank}"
    process = context.Process(
        target=run_engine_core, args=(options, input_address, output_address, model_name),
        kwargs={"dp_rank": dp_rank}, name=name, daemon=True,
    )
    process.start()
    return process


def run_engine_core(options: EngineOptions, input_address: str, output_address: str,
                    model_name: str, *, dp_rank: int | None = None,
                    own_signals: bool = True) -> None:
    """The process's entry point (``own_signals``: False in a Ray actor, whose
    process Ray manages)."""
    if own_signals:
        # Ctrl-C reaches the whole process group: the front end handles it and
        # sends us a shutdown message (or dies, which we notice).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # SIGTERM to the whole group (systemd, Kubernetes) must not cut the drain:
        # the front end drains, then sends shutdown; we also exit if it dies.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.SNDHWM, 0)
    outputs.connect(output_address)
    try:
        from cadence.engine.builder import build_engine

        engine = build_engine(options)
        if dp_rank is not None and engine.core.event_publisher is not None:
            engine.core.event_publisher.data_parallel_rank = dp_rank
    except Exception:
        outputs.send_multipart(wire.encode(wire.FAILED, wire.EngineFailed(traceback.format_exc())))
        outputs.close(linger=2000)
        sys.exit(1)
    proc = EngineCoreProc(engine, inputs, outputs)
    outputs.send_multipart(wire.encode(wire.READY, proc.ready_message(model_name)))
    try:
        proc.run()
    except Exception:
        outputs.send_multipart(wire.encode(wire.FAILED, wire.EngineFailed(traceback.format_exc())))
        outputs.close(linger=2000)
        sys.exit(1)
    engine.core.shutdown()
    context.destroy(linger=0)


class EngineCoreProc:
    """One engine core and its two sockets."""

    def __init__(self, engine: Any, inputs: zmq.Socket, outputs: zmq.Socket) -> None:
        self.engine = engine
        self.core = engine.core
        self.inputs = inputs
        self.outputs = outputs
        self.running = True
        self._last_idle_stats = 0.0
        self._stepped_since_idle = False
        self._parent_pid = os.getppid()
        self._poller = zmq.Poller()
        self._poller.register(inputs, zmq.POLLIN)
        self._decoders = {
            wire.ADD: msgspec.msgpack.Decoder(wire.EngineCoreRequest),
            wire.ABORT: msgspec.msgpack.Decoder(list[str]),
            wire.FINISH_STOPPED: msgspec.msgpack.Decoder(list[str]),
            wire.UTILITY: msgspec.msgpack.Decoder(wire.UtilityCall),
        }
        self._handlers = {
            wire.ADD: self._add, wire.ABORT: self.core.abort_requests,
            wire.FINISH_STOPPED: self.core.finish_by_stop_string, wire.UTILITY: self._utility,
        }

    def ready_message(self, model_name: str) -> wire.EngineReady:
        options = self.engine.options
        return wire.EngineReady(
            model_name=model_name, max_model_len=self.engine.max_model_len,
            vocab_size=self.engine.tokenizer.vocab_size,
            max_num_seqs=options.scheduler.max_num_seqs,
            num_kv_blocks=options.cache.num_gpu_blocks, block_size=options.cache.block_size,
            pooling_type=self.engine.model_config.pooling_type or "last",
        )

    def run(self) -> None:
        while self.running:
            self._receive(block=not self.core.has_work(),
                          wait_ms=_IDLE_STEP_WAIT_MS if self.core.num_idle_steps else 0)
            if self.running and self.core.has_work():
                self._step()

    def _receive(self, block: bool, wait_ms: int = 0) -> None:
        """Handle every queued message; first wait for one if ``block``, or up to
        ``wait_ms``."""
        while block and self.running and not self._poller.poll(_IDLE_POLL_MS):
            self._check_parent()
            self._return_freed_memory()
        if wait_ms and not block:
            self._poller.poll(wait_ms)
        while self.running:
            try:
                kind, payload = self.inputs.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if kind == wire.SHUTDOWN:
                self.running = False
                return
            self._handlers[kind](self._decoders[kind].decode(payload))

    def _return_freed_memory(self) -> None:
        """Once per idle period (the first idle poll after a step): the runner
        keeps a step's freed buffers in the heap for the next step
        (``host_memory.keep_freed_memory``), so a long prompt's or a large
        batch's step would hold tens of MB in the process for good (issue 30:
        RSS after abusive requests); trimmed here, a busy engine reuses its
        pages step after step and an idle one returns them."""
        if self._stepped_since_idle:
            self._stepped_since_idle = False
            return_freed_memory()

    def _step(self) -> None:
        self._stepped_since_idle = True
        outputs = self.core.step()
        errors, faults = self.core.take_request_errors(), self.core.take_runner_faults()
        for request_id, why in errors.items():
            error = wire.RequestError(request_id, why, internal=request_id in faults)
            self.outputs.send_multipart(wire.encode(wire.REQUEST_ERROR, error))
        if not outputs:
            # No request produced anything (prefill chunks, or only frees after an
            # abort): still send the stats, so gauges such as KV usage stay current;
            # while steps only wait for KV transfers, now and then, and at the end.
            outputs = {} if self._skip_idle_stats() else {0: wire_stats(self.core.scheduler)}
        for engine_core_outputs in outputs.values():
            stats = engine_core_outputs.scheduler_stats
            if stats is not None and stats.prefix_cache_stats is None:
                stats.prefix_cache_stats = PrefixCacheStats()
            self.outputs.send_multipart(wire.encode(wire.OUTPUTS, engine_core_outputs), copy=False)
        self._check_parent()

    def _skip_idle_stats(self) -> bool:
        now = time.monotonic()
        if (self.core.num_idle_steps > 1 and self.core.has_work()
                and now - self._last_idle_stats < _IDLE_STATS_INTERVAL_S):
            return True
        self._last_idle_stats = now
        return False

    def _add(self, message: wire.EngineCoreRequest) -> None:
        try:
            if message.priority and not self.core.scheduler.policy.reads_priority:
                raise ValueError("priority: this server schedules first come, first served; "
                                 "start it with --policy priority to use request priorities")
            if (message.slo_ttft_s is not None or message.slo_tpot_s is not None) \
                    and not self.core.scheduler.policy.reads_slo:
                raise ValueError("slo_ttft_s: this server does not schedule for latency targets; "
                                 "start it with --policy slo to use them")
            self.core.add_request(message.to_request(self.engine.max_model_len))
        except ValueError as err:
            error = wire.RequestError(message.request_id, str(err))
            self.outputs.send_multipart(wire.encode(wire.REQUEST_ERROR, error))
        except AdmissionRefused as err:
            error = wire.RequestError(message.request_id, str(err), err.retry_after_s)
            self.outputs.send_multipart(wire.encode(wire.REQUEST_ERROR, error))

    def _utility(self, call: wire.UtilityCall) -> None:
        try:
            result = self._run_utility(call.method, *call.args)
            reply = wire.UtilityResult(call.call_id, result)
        except Exception as err:  # reported to the caller, the engine goes on
            reply = wire.UtilityResult(call.call_id, error=f"{type(err).__name__}: {err}")
        self.outputs.send_multipart(wire.encode(wire.UTILITY_RESULT, reply))

    def _run_utility(self, method: str, *args: Any) -> Any:
        scheduler = self.core.scheduler
        if method == "stats":
            num_running, num_waiting = scheduler.get_request_counts()
            return {
                "num_running_reqs": num_running, "num_waiting_reqs": num_waiting,
                "kv_cache_usage": scheduler.kv_cache_manager.usage,
                "num_free_blocks": scheduler.kv_cache_manager.num_free_blocks,
                "num_steps": self.core.num_steps,
            }
        if method == "reset_prefix_cache":
            return self.core.reset_prefix_cache()  # publishes AllBlocksCleared at once
        if method == "ping":
            return "pong"
        if method in ("add_lora", "remove_lora", "list_loras"):
            return self._lora_utility(method, *args)
        raise ValueError(f"method: unknown utility {method!r}")

    def _lora_utility(self, method: str, *args: Any) -> Any:
        """add_lora(name, int_id, path) -> loaded now; remove_lora(int_id); list_loras()."""
        if method == "add_lora":
            return self.core.add_lora(LoRARequest(*args))
        if method == "remove_lora":
            return self.core.remove_lora(*args)
        return self.core.list_loras()

    def _check_parent(self) -> None:
        if os.getppid() != self._parent_pid:  # the front end is gone: nobody reads us
            self.running = False


def return_freed_memory() -> None:
    """glibc's malloc_trim (imported here: the front end imports this module without torch)."""
    from cadence.runner.host_memory import return_freed_memory as trim

    trim()


def wire_stats(scheduler: Any) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs=[], scheduler_stats=scheduler.make_stats())
