"""``AsyncLLM``: the asyncio front end of an engine core that runs in its own process.

    HTTP handlers ──add_request──► AsyncLLM ──ZMQ PUSH (msgpack)──► engine-core process
         ▲                           │  ▲                              (schedule, execute,
         │ RequestOutput per step    │  └──ZMQ PULL◄── EngineCoreOutputs   update_from_output)
         └──── per-request queue ◄───┘       (+ SchedulerStats)

The front end keeps the tokenizer and the ``OutputProcessor`` (detokenization,
stop strings, logprob rows), so none of that work delays an engine step. A
stop string found here is sent back to the engine, which finishes the request
as FINISHED_STOPPED. The engine process is watched through its sentinel: when
it dies, requests in flight get ``EngineDeadError`` and new ones are refused.

The messages on the two sockets are in ``cadence.engine.wire``; the engine
process's loop is in ``cadence.engine.core_proc``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Protocol

import zmq
import zmq.asyncio

from cadence.config import EngineConfig, EngineOptions
from cadence.core.outputs import EngineCoreOutputs, SchedulerStats
from cadence.core.sched.policy import configured_policy
from cadence.core.request import LoRARequest, Request
from cadence.engine.core_proc import start_engine_process
from cadence.engine.inputs import make_request
from cadence.engine.kv_connectors import kv_transfer_params_checker
from cadence.engine.output_processor import OutputProcessor
from cadence.engine.outputs import RequestOutput
from cadence.engine.wire import (
    ABORT, ADD, FAILED, FINISH_STOPPED, OUTPUTS, READY, REQUEST_ERROR, SHUTDOWN, UTILITY,
    UTILITY_RESULT, EngineCoreRequest, EngineReady, UtilityCall, decode, encode,
)
from cadence.models.hub import resolve_model_options
from cadence.models.tokenizer import Tokenizer
from cadence.sampling_params import SamplingParams
from cadence.structured import GrammarLimits, IsolatedGrammarChecker

logger = logging.getLogger("cadence.async_llm")

# ---------------------------------------------------------------- helpers


def check_priority(priority: Any) -> None:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority: must be an integer, got {priority!r}")
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority: must be a signed 64-bit integer in [{MIN_PRIORITY}, "
                         f"{MAX_PRIORITY}], got {priority}")


def new_ipc_addresses() -> tuple[str, str, str]:
    """(folder, input address, output address): Unix sockets in a private folder."""
    folder = tempfile.mkdtemp(prefix="cadence-")
    return folder, f"ipc://{folder}/input", f"ipc://{folder}/output"


def bind(socket: zmq.Socket, ipc_address: str, tcp_host: str | None) -> str:
    """Bind ``socket`` to ``ipc_address``, or to a free TCP port on every interface
    when ``tcp_host`` is given; the address an engine connects to."""
    if tcp_host is None:
        socket.bind(ipc_address)
        return ipc_address
    port = socket.bind_to_random_port("tcp://*")
    return f"tcp://{tcp_host}:{port}"


# ---------------------------------------------------------------- errors


class EngineDeadError(RuntimeError):
    """The engine-core process is gone."""


class RequestFailed(RuntimeError):
    """The engine failed on this request (a step that raised was taken back and
    the request ended alone; HTTP 500); the engine goes on with the others."""


class QueueFullError(RuntimeError):
    """Too many requests wait for a running slot, or a latency target is out of
    reach (answered with HTTP 429; ``retry_after_s`` becomes Retry-After)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


# The engine orders by priority as a signed 64-bit integer (msgpack carries no more).
MIN_PRIORITY, MAX_PRIORITY = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class FrontendState:
    """What requests hold in the front end; all zero when none is in flight.

    Every request takes each of these in ``add_request`` and gives each back
    when it finishes, is aborted, fails, or is refused half-way (a failed send).
    """

    open_requests: int  # requests with an output queue, a timing or a sequence count
    unfinished_seqs: int  # sequences counted against max_num_seqs + the queue limit
    output_requests: int  # requests the OutputProcessor detokenizes
    output_routes: int  # engine ids the OutputProcessor routes (a request, or its n children)
    pending_utility_calls: int

    @property
    def is_idle(self) -> bool:
        return not any(getattr(self, f.name) for f in fields(self))


# ---------------------------------------------------------------- stats


class StatLogger(Protocol):
    """What the front end reports (``cadence.server.metrics`` implements it)."""

    def record_scheduler_stats(self, stats: SchedulerStats) -> None: ...

    def record_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None: ...

    def record_tokens(self, num_tokens: int, inter_token_latency_s: float | None) -> None: ...

    def record_finished(self, e2e_s: float, ttft_s: float | None, finish_reason: str,
                        num_prompt_tokens: int, num_generation_tokens: int) -> None: ...

    def record_slo(self, met: bool) -> None: ...

    def watch_frontend(self, read: Callable[[], FrontendState]) -> None:
        """Report ``read()`` when asked (gauges read at scrape time, never stale)."""
        ...


@dataclass
class _Timing:
    arrival: float
    num_prompt_tokens: int
    first_token: float | None = None
    last_token: float | None = None
    num_generation_tokens: int = 0
    # Latency targets (policy slo): the request's own, else the deployment's.
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None

    def slo_met(self, now: float, num_tokens: int) -> bool | None:
        """Whether a finished request met its targets (None: it had none)."""
        if self.slo_ttft_s is None and self.slo_tpot_s is None:
            return None
        if self.first_token is None:
            return False
        ttft_ok = self.slo_ttft_s is None or self.first_token - self.arrival <= self.slo_ttft_s
        tpot = (now - self.first_token) / (num_tokens - 1) if num_tokens > 1 else 0.0
        return ttft_ok and (self.slo_tpot_s is None or tpot <= self.slo_tpot_s)


# ---------------------------------------------------------------- tokenizer


def load_tokenizer(model: str | None) -> Tokenizer:
    """The tokenizer alone (no weights): GGUF metadata, or a Hugging Face folder."""
    from cadence.models.gguf_loader import read_gguf
    from cadence.models.default_model import default_model_path

    path = default_model_path() if model is None else model
    if path.endswith(".gguf"):
        return Tokenizer.from_gguf_metadata(read_gguf(path)[1])
    return Tokenizer.from_directory(path)


# ---------------------------------------------------------------- the client


class RequestStream:
    """The outputs of one request, as an async iterator of ``RequestOutput``.

    Each item carries everything so far (text, token ids, logprob rows), so
    outputs that queued up while the consumer was busy are merged into the
    latest. ``close()`` aborts the request if it has not finished.
    """

    def __init__(self, llm: "AsyncLLM", request_id: str, queue: asyncio.Queue) -> None:
        self.llm = llm
        self.request_id = request_id
        self._queue = queue
        self._first: RequestOutput | None = None  # taken by wait_accepted, not yet iterated
        self.finished = False

    async def wait_accepted(self) -> None:
        """Wait until the engine sends the first output, or raise its refusal
        (``QueueFullError`` when the load refused it): what a server does
        before it commits to a 200 for a stream that the engine may refuse."""
        if self._first is None and not self.finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self._first = item

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        if self._first is not None:
            item, self._first = self._first, None
        else:
            item = await self._queue.get()
        while not isinstance(item, BaseException) and not item.finished and not self._queue.empty():
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.llm.abort(self.request_id)


class AsyncLLM:
    """Streams requests through an engine-core process (see the module docstring).

    Life cycle: ``AsyncLLM()`` binds the sockets; ``await start(options,
    model_name)`` spawns the engine process on them and waits for its
    handshake; ``shutdown()`` stops both.
    """

    def __init__(self, *, stat_logger: StatLogger | None = None,
                 max_num_queued_requests: int | None = None, tcp_host: str | None = None) -> None:
        """``tcp_host``: talk to the engine over TCP, the engine connecting to this
        host (an engine on another machine), instead of over Unix sockets."""
        self._folder, input_address, output_address = new_ipc_addresses()
        self._slo_defaults: tuple[float | None, float | None] = (None, None)  # see start
        self._grammar_backend_name = "llguidance"  # see start
        self._grammar_limits = GrammarLimits.of(EngineConfig())  # see start
        # Whether the engine may refuse a request after it was sent (--slo-reject).
        self.refuses_under_load = False
        # Checks grammars before they are sent, in a worker process (a crash there is one 400).
        self._grammars: IsolatedGrammarChecker | None = None
        # Checks a request's kv_transfer_params (None: the engine's connector reads none).
        self._kv_transfer_check: Callable[[Any], None] | None = None  # see start
        # Sends go through a plain socket: a PUSH with no high-water mark never
        # blocks, so a handler or the output loop can send without awaiting.
        self._send_ctx = zmq.Context()
        self._input = self._send_ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self.input_address = bind(self._input, input_address, tcp_host)
        self._ctx = zmq.asyncio.Context()
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self.output_address = bind(self._output, output_address, tcp_host)
        self.stat_logger = stat_logger
        self.max_num_queued_requests = max_num_queued_requests
        self.tokenizer: Tokenizer | None = None
        self.info: EngineReady | None = None
        self.process: Any = None
        self._processor: OutputProcessor | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._timings: dict[str, _Timing] = {}
        self._num_seqs: dict[str, int] = {}
        self._num_unfinished_seqs = 0
        self._utility_ids = itertools.count()
        self._utility_futures: dict[int, asyncio.Future] = {}
        self._output_task: asyncio.Task | None = None
        self._dead: EngineDeadError | None = None
        self._failure: str | None = None
        if stat_logger is not None:
            stat_logger.watch_frontend(self.frontend_state)

    # ------------------------------------------------------------ start / stop

    async def start(self, options: EngineOptions, model_name: str,
                    timeout_s: float = 600.0) -> EngineReady:
        """Spawn the engine process, load the tokenizer alone (off the loop, while the
        engine builds; the weights live in the engine process) and wait for the handshake.
        A Hub id is fetched first (``cadence serve`` has done it: then it is a local path)."""
        options = await asyncio.to_thread(resolve_model_options, options)
        scheduler = options.scheduler
        self._grammar_backend_name = options.engine.structured_outputs_backend
        self._grammar_limits = GrammarLimits.of(options.engine)
        policy = configured_policy(scheduler)  # its options refused here, before a process starts
        self.refuses_under_load = policy.may_refuse_admission()
        self._slo_defaults = policy.latency_targets()
        self._kv_transfer_check = kv_transfer_params_checker(options.kv_transfer)
        process = self._spawn_engine(options, model_name)
        self.process = process  # owned from here: shutdown() stops it even if loading fails
        tokenizer = await asyncio.to_thread(load_tokenizer, options.engine.model)
        return await self._attach(process, tokenizer, timeout_s)

    def _spawn_engine(self, options: EngineOptions, model_name: str) -> Any:
        """The engine process (anything with a ``multiprocessing.Process``'s
        sentinel, is_alive, join, kill, exitcode and pid)."""
        return start_engine_process(options, self.input_address, self.output_address, model_name)

    async def _attach(self, process: Any, tokenizer: Tokenizer, timeout_s: float) -> EngineReady:
        """Wait for the engine's handshake, then start routing its outputs."""
        self.process, self.tokenizer = process, tokenizer
        self._processor = OutputProcessor(tokenizer)
        loop = asyncio.get_running_loop()
        loop.add_reader(process.sentinel, self._on_engine_exit)
        deadline = time.monotonic() + timeout_s
        while self.info is None:
            if self._dead is not None:
                raise self._dead
            if time.monotonic() > deadline:
                raise EngineDeadError(f"the engine process sent no handshake in {timeout_s:.0f} s")
            if await self._output.poll(200):
                self._dispatch(await self._output.recv_multipart())
        self._output_task = asyncio.create_task(self._output_loop(), name="cadence-engine-outputs")
        self._grammars = IsolatedGrammarChecker(self._grammar_backend_name, tokenizer, self.info.vocab_size,
                                                self._grammar_limits)
        return self.info

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the engine process; what is still in flight fails, new requests are refused."""
        if self._dead is None:
            self._dead = EngineDeadError("the server is shutting down")
        if self.process is not None:
            try:
                asyncio.get_running_loop().remove_reader(self.process.sentinel)
            except (ValueError, OSError):
                pass
            if self.process.is_alive():
                self._send(SHUTDOWN, None)
                await asyncio.to_thread(self.process.join, timeout_s)
            if self.process.is_alive():
                self.process.kill()  # it ignores SIGTERM (kept for the drain) and did not stop
                await asyncio.to_thread(self.process.join, timeout_s)
        if self._output_task is not None:
            self._output_task.cancel()
        self._fail_all(self._dead)
        self._report_engine_gone()
        if self._grammars is not None:
            self._grammars.close()
        self._ctx.destroy(linger=0)
        self._send_ctx.destroy(linger=0)
        shutil.rmtree(self._folder, ignore_errors=True)

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self.info is not None

    @property
    def engine_process_running(self) -> bool:
        """The engine process is up (it may refuse requests already: see ``abort_all``)."""
        return self.process is not None and self.process.is_alive()

    def frontend_state(self) -> FrontendState:
        """The front end's per-request state, for /metrics and the tests' invariant check."""
        num_states, num_routes = (self._processor.num_entries() if self._processor is not None
                                  else (0, 0))
        return FrontendState(
            open_requests=len(self._queues.keys() | self._timings.keys() | self._num_seqs.keys()),
            unfinished_seqs=self._num_unfinished_seqs, output_requests=num_states,
            output_routes=num_routes, pending_utility_calls=len(self._utility_futures))

    @property
    def seq_capacity(self) -> int | None:
        """Sequences that may be in flight at once (running or queued); None: no limit."""
        if self.max_num_queued_requests is None or self.info is None:
            return None
        return self.info.max_num_seqs + self.max_num_queued_requests

    # ------------------------------------------------------------ requests

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
        prompt: str | None = None, priority: int = 0, user: str | None = None,
        slo_ttft_s: float | None = None, slo_tpot_s: float | None = None,
        lora_request: LoRARequest | None = None, kv_transfer_params: dict | None = None,
    ) -> RequestStream:
        """Validate and submit; raises ValueError (bad input), QueueFullError, EngineDeadError.

        All checks come before the request takes anything; if registering or the
        send fails anyway, everything it took is given back before the error goes
        on (a leaked sequence count would answer 429 to every later request).
        """
        if self._dead is not None:
            raise self._dead
        assert self.info is not None and self.tokenizer is not None and self._processor is not None
        if request_id in self._queues:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        check_priority(priority)
        self.check_structured_outputs(params)
        if kv_transfer_params is not None:
            params = self._with_kv_transfer_params(params, kv_transfer_params)
        request = make_request(request_id, prompt_token_ids, params, self.tokenizer,
                               self.info.max_model_len, priority=priority, user=user,
                               slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s,
                               lora_request=lora_request)
        self.check_can_ever_admit(params.n)
        self._check_queue(params.n)
        message = encode(ADD, EngineCoreRequest.from_request(request))
        try:
            queue = self._register(request, prompt)
            self._input.send_multipart(message, copy=False)
        except BaseException:
            self._release(request_id)
            raise
        return RequestStream(self, request_id, queue)

    def check_structured_outputs(self, params: SamplingParams) -> None:
        """Raise ValueError (HTTP 400) naming what in ``params.structured_outputs``
        is over a limit, cannot compile or can never be satisfied. The grammar
        library runs in a worker process and may take up to the compile timeout:
        a server calls this in a worker thread first; ``add_request`` then hits
        the cache."""
        if params.structured_outputs is not None and self._grammars is not None:
            self._grammars.check(params.structured_outputs)

    def _with_kv_transfer_params(self, params: SamplingParams, kv_transfer_params: Any
                                 ) -> SamplingParams:
        """``params`` carrying ``kv_transfer_params`` to the engine's KV connector
        (vLLM's place for them: ``extra_args``); ValueError naming the field when
        this engine's connector cannot act on them, or it has none."""
        if self._kv_transfer_check is None:
            raise ValueError("kv_transfer_params: this server has no KV connector that reads "
                             "them (start it with --kv-transfer-config, e.g. "
                             "'{\"kv_connector\": \"PDConnector\", \"kv_role\": \"kv_producer\"}')")
        if params.n != 1:
            raise ValueError("kv_transfer_params: only with n=1")
        self._kv_transfer_check(kv_transfer_params)
        extra_args = {**(params.extra_args or {}), "kv_transfer_params": kv_transfer_params}
        return params.replace(extra_args=extra_args)

    def check_can_ever_admit(self, num_seqs: int) -> None:
        """Refuse (ValueError, HTTP 400) what no wait would let in: more sequences
        than may run and queue at once. One that would fit later gets 429 instead."""
        capacity = self.seq_capacity
        if capacity is not None and num_seqs > capacity:
            assert self.info is not None
            raise ValueError(
                f"n: {num_seqs} sequences can never be admitted: this server runs at most "
                f"{self.info.max_num_seqs} at once and queues {self.max_num_queued_requests} more "
                f"(--max-num-seqs, --max-num-queued-requests); ask for at most {capacity}")

    def abort_all(self, reason: str) -> None:
        """Fail every request in flight with ``EngineDeadError(reason)`` and refuse new
        ones: the server is stopping. A live engine drops them and frees their blocks."""
        error = EngineDeadError(reason)
        if self._dead is None:
            self._dead = error
            engine_ids = [engine_id for request_id in self._queues
                          for engine_id in self._processor.engine_request_ids(request_id)]
            if engine_ids:
                self._send(ABORT, engine_ids)
        self._fail_all(error)

    def abort(self, request_id: str) -> None:
        """Forget a request (client gone) and free its blocks in the engine."""
        if request_id not in self._queues or self._processor is None:
            return
        engine_ids = self._processor.engine_request_ids(request_id)
        output = self._processor.abort(request_id)
        if engine_ids and self._dead is None:
            self._send(ABORT, engine_ids)
        if output is not None:
            self._record(output, time.time())
        self._forget(request_id)

    async def call_utility(self, method: str, *args: Any, timeout_s: float = 10.0) -> Any:
        """Run a utility method in the engine process ("stats", "reset_prefix_cache")."""
        if self._dead is not None:
            raise self._dead
        call_id = next(self._utility_ids)
        future = asyncio.get_running_loop().create_future()
        self._utility_futures[call_id] = future
        self._send(UTILITY, UtilityCall(call_id, method, list(args)))
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._utility_futures.pop(call_id, None)

    async def add_lora(self, lora_request: LoRARequest, timeout_s: float = 120.0) -> bool:
        """Load an adapter in the engine process (True: loaded now, False: it was);
        ValueError naming what is wrong with it (the engine goes on)."""
        try:
            return await self.call_utility("add_lora", lora_request.lora_name,
                                           lora_request.lora_int_id, lora_request.lora_path,
                                           timeout_s=timeout_s)
        except RuntimeError as err:
            message = str(err)
            if message.startswith("ValueError: "):
                raise ValueError(message.removeprefix("ValueError: ")) from None
            raise

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter (once the requests using it finish); False if not loaded."""
        return await self.call_utility("remove_lora", lora_int_id)

    def _check_queue(self, num_seqs: int) -> None:
        # Sequences beyond max_num_seqs cannot run: they wait in the engine's queue.
        capacity = self.seq_capacity
        if capacity is None:
            return
        assert self.info is not None
        if self._num_unfinished_seqs + num_seqs > capacity:
            num_queued = max(0, self._num_unfinished_seqs - self.info.max_num_seqs)
            raise QueueFullError(
                f"the server's queue is full: {num_queued} sequences are waiting for one of the "
                f"{self.info.max_num_seqs} running slots (--max-num-queued-requests "
                f"{self.max_num_queued_requests}); retry later")

    def _register(self, request: Request, prompt: str | None) -> asyncio.Queue:
        """Take the front end's state for a request: queue, timing, seats, detokenizer."""
        assert self._processor is not None
        request_id, params = request.request_id, request.sampling_params
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        ttft_default, tpot_default = self._slo_defaults
        self._timings[request_id] = _Timing(
            request.arrival_time, request.num_prompt_tokens,
            slo_ttft_s=request.slo_ttft_s if request.slo_ttft_s is not None else ttft_default,
            slo_tpot_s=request.slo_tpot_s if request.slo_tpot_s is not None else tpot_default)
        self._num_seqs[request_id] = params.n
        self._num_unfinished_seqs += params.n
        self._processor.add_request(request_id, prompt, request.prompt_token_ids, params)
        return queue

    def _release(self, request_id: str) -> None:
        """Give back all ``_register`` took (any part of it), without telling the engine."""
        if self._processor is not None:
            self._processor.abort(request_id)
        self._forget(request_id)

    def _send(self, kind: bytes, payload: Any) -> None:
        self._input.send_multipart(encode(kind, payload), copy=False)

    # ------------------------------------------------------------ outputs

    async def _output_loop(self) -> None:
        try:
            while True:
                self._dispatch(await self._output.recv_multipart())
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError:
            if self._dead is None:
                self._mark_dead("the engine connection closed")
        except Exception:  # a bug here must not leave requests hanging
            logger.exception("cadence: the output loop failed")
            self._mark_dead("the server's output loop failed")

    def _dispatch(self, frames: list[bytes]) -> None:
        kind, payload = frames[0], frames[1]
        message = decode(kind, payload)
        if kind == OUTPUTS:
            self._handle_outputs(message)
        elif kind == READY:
            self.info = message
        elif kind == UTILITY_RESULT:
            future = self._utility_futures.get(message.call_id)
            if future is not None and not future.done():
                if message.error is not None:
                    future.set_exception(RuntimeError(message.error))
                else:
                    future.set_result(message.result)
        elif kind == REQUEST_ERROR:
            if message.retry_after_s is not None:  # refused for the load: try again later
                error: Exception = QueueFullError(message.message, retry_after_s=message.retry_after_s)
            elif message.internal:
                error = RequestFailed(message.message)
            else:
                error = ValueError(message.message)
            self._fail_request(message.request_id, error)
        elif kind == FAILED:
            self._failure = message.message
            logger.error("cadence: the engine failed:\n%s", message.message)

    def _handle_outputs(self, outputs: EngineCoreOutputs) -> None:
        assert self._processor is not None
        now = time.time()
        results, stopped = self._processor.process(outputs.outputs)
        if stopped:
            self._send(FINISH_STOPPED, stopped)
        for result in results:
            self._record(result, now)
            queue = self._queues.get(result.request_id)
            if queue is not None:
                queue.put_nowait(result)
            if result.finished:
                self._forget(result.request_id)
        # After the engine is gone (or told to stop), a late step must not bring back its gauges.
        if outputs.scheduler_stats is not None and self.stat_logger is not None and self._dead is None:
            self.stat_logger.record_scheduler_stats(outputs.scheduler_stats)

    def _record(self, output: RequestOutput, now: float) -> None:
        timing = self._timings.get(output.request_id)
        if timing is None or self.stat_logger is None:
            return
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        num_new = num_tokens - timing.num_generation_tokens
        if num_new > 0:
            if timing.first_token is None:
                timing.first_token = now
                self.stat_logger.record_first_token(now - timing.arrival, timing.num_prompt_tokens)
                self.stat_logger.record_tokens(num_new, None)
            else:
                self.stat_logger.record_tokens(num_new, now - (timing.last_token or now))
            timing.last_token = now
            timing.num_generation_tokens = num_tokens
        if output.finished:
            reasons = {c.finish_reason for c in output.outputs}
            reason = "abort" if "abort" in reasons else ("length" if "length" in reasons else "stop")
            ttft = timing.first_token - timing.arrival if timing.first_token is not None else None
            self.stat_logger.record_finished(now - timing.arrival, ttft, reason,
                                             timing.num_prompt_tokens, num_tokens)
            met = timing.slo_met(now, num_tokens)
            if met is not None:
                self.stat_logger.record_slo(met)

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._timings.pop(request_id, None)
        self._num_unfinished_seqs -= self._num_seqs.pop(request_id, 0)

    def _fail_request(self, request_id: str, error: BaseException) -> None:
        queue = self._queues.get(request_id)
        if queue is None:
            return
        if self._processor is not None:
            self._processor.abort(request_id)
        queue.put_nowait(error)
        self._forget(request_id)

    # ------------------------------------------------------------ liveness

    def _on_engine_exit(self) -> None:
        self.process.join(0)  # reap it, so its exit code is known
        exitcode = self.process.exitcode
        detail = f" (exit code {exitcode})" if exitcode is not None else ""
        reason = f": {self._failure.strip().splitlines()[-1]}" if self._failure else ""
        self._mark_dead(f"the engine process died{detail}{reason}")

    def _mark_dead(self, message: str) -> None:
        if self._dead is not None:
            return
        logger.error("cadence: %s", message)
        self._dead = EngineDeadError(message)
        try:
            asyncio.get_running_loop().remove_reader(self.process.sentinel)
        except (RuntimeError, ValueError, OSError, AttributeError):
            pass
        self._fail_all(self._dead)
        self._report_engine_gone()

    def _report_engine_gone(self) -> None:
        # A dead or stopped engine runs nothing and holds no KV blocks: /metrics must
        # not keep showing its last step's running and waiting requests.
        if self.stat_logger is not None:
            self.stat_logger.record_scheduler_stats(SchedulerStats())

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._queues):
            self._fail_request(request_id, error)
        for future in self._utility_futures.values():
            if not future.done():
                future.set_exception(error)

