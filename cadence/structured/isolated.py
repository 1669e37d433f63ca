"""A request's output constraint checked in a worker process, not the server's own.

The grammar libraries are native code that a request can drive: a Lark
grammar of a few thousand chained rules overflows llguidance's stack
(SIGSEGV), a large enough one panics or runs for a minute in xgrammar. The
server checks every constraint before it sends the request, so it checks
them here: one worker process, reused, one constraint at a time (``python -m
cadence.structured.check_worker``).

    check(params)
      sizes (limits.py)          in this process; over a limit -> ValueError
      the cache                  a constraint seen before answers at once
      the worker                 backend.check: compile, $ref cycles, a short walk
        answers                  None or the ValueError's message
        dies (a crash, a panic   ValueError "the grammar library crashed";
        that kills it)           a new worker starts with the next check
        runs past the timeout    killed; ValueError "timed out"

Every answer is cached, failures too, so a grammar that crashes the worker
crashes it once. A constraint that passes compiles in the engine the same
way (the same backend, the same library), so the engine meets only grammars
that a worker survived.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from cadence.models.tokenizer import Tokenizer
from cadence.sampling_params import StructuredOutputParams
from cadence.structured.backend import ConstraintCache, check_backend_available
from cadence.structured.limits import GrammarLimits, check_size

logger = logging.getLogger("cadence.structured")

_UNKNOWN = object()  # no answer cached yet
# A worker's start (spawn, imports, the tokenizer sent over) is not the
# constraint's fault: it gets its own, longer, limit.
WORKER_START_TIMEOUT_S = 120.0
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class GrammarCheckerUnavailable(RuntimeError):
    """The worker could not start: a fault of the server, not of the request (a 500)."""


class IsolatedGrammarChecker:
    """Checks constraints with backend ``backend_name`` over ``tokenizer`` in a
    worker process; thread-safe (checks wait for one another)."""

    def __init__(self, backend_name: str, tokenizer: Tokenizer, vocab_size: int,
                 limits: GrammarLimits) -> None:
        check_backend_available(backend_name)
        self.backend_name = backend_name
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.limits = limits
        # One check in the worker at a time; the answers have their own lock, so
        # that a cached answer never waits behind a compile (add_request's check
        # runs on the server's event loop).
        self._worker_lock = threading.Lock()
        self._answers = ConstraintCache()  # key -> error or None
        self._worker: _Worker | None = None
        self._closed = False
        self.num_worker_starts = 0

    def check(self, params: StructuredOutputParams) -> None:
        """ValueError naming the field if ``params`` is over a limit, cannot
        compile, or nothing satisfies it; blocks for up to the compile timeout."""
        check_size(params, self.limits)
        key = ConstraintCache.key(params)
        error = self._answers.get(key, _UNKNOWN)
        if error is _UNKNOWN:
            with self._worker_lock:
                error = self._answers.get(key, _UNKNOWN)  # another thread may have asked meanwhile
                if error is _UNKNOWN:
                    error = self._ask_worker(params)
                    self._answers.put(params, error)
        if error is not None:
            raise ValueError(error)

    def close(self) -> None:
        """Stop the worker (without waiting for a check in progress: it fails)."""
        self._closed = True
        worker = self._worker
        if worker is not None:
            worker.process.kill()

    def _ask_worker(self, params: StructuredOutputParams) -> str | None:
        """The worker's answer (None: the constraint is fine); called under the worker lock."""
        if self._closed:
            raise GrammarCheckerUnavailable("structured_outputs: the server is shutting down")
        if self._worker is None:
            self._worker = _Worker.start(self.backend_name, self.tokenizer, self.vocab_size)
            self.num_worker_starts += 1
        field = f"structured_outputs.{params.kind}"
        timeout_s = self.limits.compile_timeout_s
        outcome, answer = self._worker.ask((params.kind, getattr(params, params.kind)), timeout_s)
        if outcome == "answer":
            return answer
        worker, self._worker = self._worker, None
        worker.stop()
        if outcome == "timeout":
            logger.warning("cadence: a %s constraint took longer than %g s to compile; refused",
                           params.kind, timeout_s)
            return (f"{field}: the grammar could not be compiled: it timed out after {timeout_s:g} s "
                    "(--structured-outputs-compile-timeout-s)")
        logger.warning("cadence: the grammar library crashed on a %s constraint (%s); refused, "
                       "and a new worker starts with the next check", params.kind, answer)
        return f"{field}: the grammar could not be compiled: the grammar library crashed ({answer})"


class _Worker:
    """One worker process and its end of the socket pair."""

    def __init__(self, process: subprocess.Popen, conn: Connection) -> None:
        self.process = process
        self.conn = conn

    @classmethod
    def start(cls, backend_name: str, tokenizer: Tokenizer, vocab_size: int) -> _Worker:
        # A plain ``python -m`` subprocess, not multiprocessing's spawn: spawn
        # runs the parent's main script again in the child, so an offline
        # script that makes an ``LLM`` without an ``if __name__ == "__main__"``
        # guard would load a second engine there and fail (and never fork a
        # threaded server).
        ours, theirs = socket.socketpair()
        # The worker imports this cadence, wherever this process found it.
        path = os.pathsep.join(filter(None, [_PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))
        try:
            process = subprocess.Popen([sys.executable, "-m", "cadence.structured.check_worker",
                                        str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                       stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": path})
        finally:
            theirs.close()
        worker = cls(process, Connection(ours.detach()))
        try:
            worker.conn.send((backend_name, tokenizer, vocab_size))
        except (BrokenPipeError, ConnectionError):
            pass  # it died at once: receive() says how
        outcome, answer = worker.receive(WORKER_START_TIMEOUT_S)
        if outcome != "answer" or answer != "ready":
            worker.stop()
            raise GrammarCheckerUnavailable(f"structured_outputs: the grammar checker's worker did not "
                                            f"start ({answer if outcome == 'answer' else outcome})")
        return worker

    def ask(self, request: tuple[str, Any], timeout_s: float) -> tuple[str, Any]:
        """("answer", the reply), ("timeout", None) or ("died", how)."""
        try:
            self.conn.send(request)
        except (BrokenPipeError, ConnectionError, EOFError):
            return "died", self._how_it_died()
        return self.receive(timeout_s)

    def receive(self, timeout_s: float) -> tuple[str, Any]:
        deadline = time.monotonic() + timeout_s
        try:
            # poll() also returns when the worker dies (its end of the pair closes).
            if not self.conn.poll(max(0.0, deadline - time.monotonic())):
                return "timeout", None
            return "answer", self.conn.recv()
        except (EOFError, ConnectionError, OSError):
            return "died", self._how_it_died()

    def _how_it_died(self) -> str:
        try:
            code = self.process.wait(5)
        except subprocess.TimeoutExpired:
            return "its worker stopped answering"
        if code < 0:
            try:
                return f"its worker died of {signal.Signals(-code).name}"
            except ValueError:
                return f"its worker died of signal {-code}"
        return f"its worker exited with status {code}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self.conn.close()


def worker_main(conn: Connection, backend_name: str, tokenizer: Tokenizer, vocab_size: int) -> None:
    """The worker's loop (``check_worker.py`` starts it): (kind, value) in, None
    or an error message out, until its parent closes the pair."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the server's to handle
    from cadence.structured.backend import make_grammar_backend, reraise_unless_library_failure

    backend = make_grammar_backend(backend_name, tokenizer, vocab_size)
    backend.prepare()  # the vocabulary tables: part of starting, not of the first check
    conn.send("ready")
    while True:
        try:
            kind, value = conn.recv()
        except (EOFError, ConnectionError):  # the server is gone
            return
        try:
            backend.check(StructuredOutputParams(**{kind: value}))
            answer = None
        except ValueError as err:
            answer = str(err)
        except BaseException as err:
            reraise_unless_library_failure(err)
            answer = f"structured_outputs.{kind}: the grammar library failed ({type(err).__name__})"
        conn.send(answer)
