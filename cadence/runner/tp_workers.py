"""The worker processes of a tensor-parallel engine (ranks 1..K-1), both sides.

Rank 0 (the engine core's process) starts each worker as ``python -m
cadence.runner.tp_workers FD``, FD being its end of a socket pair: a plain
subprocess, so an engine core that is itself a daemon process may start
them. Over that pair, pickled messages:

    rank 0                                   worker r
    hello(rank, size, port, threads)  ->
                                      <-     joining        (then both join the gloo group)
    build(config, dtype, its weights,
          runner arguments)           ->
                                      <-     ready          (its ShardRunner built)
    step(SchedulerOutput)             ->     (every step; collectives inside)
    shutdown                          ->     exits
                                      <-     failed(traceback), at any point, then exits

The pair is also how each side learns the other is gone. A worker waits
on it with no timeout (an idle engine sends nothing for hours) and exits
when it reads end-of-file: its engine died, however it died, so no worker
outlives its engine. Rank 0 checks that every worker lives before it sends
a step, and a worker that dies mid-step breaks the step's collective at
once; either way rank 0 raises ``WorkerFailed`` with the worker's own
traceback when it sent one.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import traceback
import weakref
from multiprocessing.connection import Connection
from typing import Any

import torch

from cadence.models.tensor_parallel import build_shard, rank_config, shard_weights
from cadence.models.tp_group import TensorParallelGroup, make_store
from cadence.runner.tp_runner import DriverRunner, ShardRunner

# Bounds a collective whose peer hangs (a dead peer fails it at once), and the rendezvous.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
SHUTDOWN_GRACE_S = 5.0
FAILURE_GRACE_S = 5.0  # after a collective fails: how long a worker may take to die or report
_POLL_S = 0.2


def collective_backend(device: torch.device) -> str:
    """The torch.distributed backend for ranks on ``device``'s kind (gloo's path is the one built)."""
    return "nccl" if device.type == "cuda" else "gloo"


class WorkerFailed(RuntimeError):
    """A tensor-parallel worker died or raised; the engine cannot step any more."""


def start_driver(model: torch.nn.Module, model_config: Any, size: int, *, num_threads: int,
                 **runner_args: Any) -> DriverRunner:
    """Rank 0's runner over ``size`` ranks: the workers started and built, ``model``
    (loaded whole, on the CPU) split among all ranks. ``runner_args``: ``ModelRunner``'s."""
    store = make_store(0, size, 0, COLLECTIVE_TIMEOUT)
    pool = WorkerPool.start(size, store.port, num_threads)
    try:
        pool.wait_for("joining")
        group = TensorParallelGroup.connect(store, 0, size, backend="gloo", timeout=COLLECTIVE_TIMEOUT)
        dtype = runner_args["dtype"]
        for rank, worker in enumerate(pool.workers, start=1):
            worker.send(("build", (model_config, dtype, shard_weights(model, rank, size), runner_args)))
        shard = build_shard(model_config, group, dtype, shard_weights(model, 0, size))
        runner = DriverRunner(shard, rank_config(model_config, size), group=group, workers=pool,
                              **runner_args)
        pool.wait_for("ready")
    except BaseException:
        pool.shutdown()
        raise
    pool.store = store  # the rendezvous lives as long as the group
    return runner


class Worker:
    """Rank 0's handle on one worker process: its process and its end of the pair."""

    def __init__(self, rank: int, process: subprocess.Popen, conn: Connection) -> None:
        self.rank = rank
        self.process = process
        self.conn = conn
        self.failure: str | None = None  # the traceback it sent, if any

    def send(self, message: tuple[str, Any]) -> None:
        if self.process.poll() is not None:
            raise self.failed()
        try:
            self.conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError as err:  # it died between the check and the send
            raise self.failed() from err

    def receive(self, expected: str) -> None:
        """Wait for message ``expected``; WorkerFailed if the worker fails or dies first."""
        while not self.conn.poll(_POLL_S):
            if self.process.poll() is not None and not self.conn.poll(0):
                raise self.failed()
        try:
            kind, payload = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError) as err:
            raise self.failed() from err
        if kind == "failed":
            self.failure = payload
            raise self.failed()
        if kind != expected:
            raise WorkerFailed(f"tensor parallel worker rank {self.rank}: sent {kind!r}, not {expected!r}")

    def read_failure(self) -> None:
        """Take the traceback the worker sent before it died, if it sent one."""
        try:
            while self.failure is None and self.conn.poll(0):
                kind, payload = pickle.loads(self.conn.recv_bytes())
                if kind == "failed":
                    self.failure = payload
        except (EOFError, OSError):
            pass

    def failed(self) -> WorkerFailed:
        self.read_failure()
        code = self.process.poll()
        state = "is running" if code is None else f"exited with code {code}"
        detail = f":\n{self.failure}" if self.failure else ""
        return WorkerFailed(f"tensor parallel worker rank {self.rank} failed (its process {state}){detail}")


class WorkerPool:
    """Ranks 1..size-1 as processes of this machine."""

    def __init__(self, workers: list[Worker]) -> None:
        self.workers = workers
        self.store = None
        # Stop them when the pool is dropped or the interpreter exits, at the latest.
        self._finalizer = weakref.finalize(self, _stop_workers, list(workers))

    @classmethod
    def start(cls, size: int, port: int, num_threads: int) -> "WorkerPool":
        workers = []
        try:
            for rank in range(1, size):
                workers.append(_spawn(rank))
                workers[-1].send(("hello", (rank, size, port, num_threads)))
        except BaseException:
            _stop_workers(workers)
            raise
        return cls(workers)

    def wait_for(self, kind: str) -> None:
        for worker in self.workers:
            worker.receive(kind)

    def send_step(self, scheduler_output: Any) -> None:
        for worker in self.workers:
            worker.send(("step", scheduler_output))

    def find_failure(self, wait_s: float = FAILURE_GRACE_S) -> WorkerFailed | None:
        """The first worker that failed or died, as an error; None when all still
        live and none reported after ``wait_s`` (a dying worker's sockets may
        close a moment before its process ends)."""
        deadline = time.monotonic() + wait_s
        while True:
            for worker in self.workers:
                worker.read_failure()
                if worker.failure is not None or worker.process.poll() is not None:
                    return worker.failed()
            if time.monotonic() > deadline:
                return None
            time.sleep(_POLL_S / 4)

    def pids(self) -> list[int]:
        return [worker.process.pid for worker in self.workers]

    def shutdown(self) -> None:
        self._finalizer()


def _spawn(rank: int) -> Worker:
    ours, theirs = socket.socketpair()
    with theirs:
        process = subprocess.Popen(
            [sys.executable, "-m", "cadence.runner.tp_workers", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
    return Worker(rank, process, Connection(ours.detach()))


def _stop_workers(workers: list[Worker]) -> None:
    """Ask each worker to exit, then kill the ones still there after a grace period."""
    for worker in workers:
        try:
            worker.conn.send_bytes(pickle.dumps(("shutdown", None)))
        except OSError:
            pass
    deadline = time.monotonic() + SHUTDOWN_GRACE_S
    for worker in workers:
        try:
            worker.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            worker.process.kill()
            worker.process.wait()
        worker.conn.close()


# ------------------------------------------------------------ the worker's side


def run_worker(conn: Connection) -> None:
    """A worker's life: join the group, build its shard, run steps until told or orphaned."""
    rank, size, port, num_threads = _receive(conn, "hello")
    torch.set_num_threads(num_threads)
    _send(conn, ("joining", None))
    store = make_store(rank, size, port, COLLECTIVE_TIMEOUT)
    group = TensorParallelGroup.connect(store, rank, size, backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    model_config, dtype, weights, runner_args = _receive(conn, "build")
    shard = build_shard(model_config, group, dtype, weights)
    del weights
    runner = ShardRunner(shard, rank_config(model_config, size), group=group, **runner_args)
    _send(conn, ("ready", None))
    while True:
        runner.execute_model(_receive(conn, "step"))


def _receive(conn: Connection, expected: str) -> Any:
    """The payload of message ``expected``; SystemExit on shutdown (at any point)."""
    kind, payload = pickle.loads(conn.recv_bytes())
    if kind == "shutdown":
        raise SystemExit(0)
    if kind != expected:
        raise RuntimeError(f"expected a {expected!r} message from rank 0, got {kind!r}")
    return payload


def _send(conn: Connection, message: tuple[str, Any]) -> None:
    conn.send_bytes(pickle.dumps(message))


def main(fd: int) -> None:
    # Ctrl-C and SIGTERM to the process group are the engine's to handle: a
    # worker exits when its engine closes the pair (shutdown, or its death).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        run_worker(conn)
    except (EOFError, SystemExit):
        os._exit(0)  # told to stop, or the engine is gone: nothing to report
    except BaseException:
        try:
            _send(conn, ("failed", traceback.format_exc()))
        except OSError:
            pass
        os._exit(1)
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]))
