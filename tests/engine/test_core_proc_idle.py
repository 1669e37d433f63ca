"""The engine-core process's loop hands freed heap memory back once per idle
period (issue 30: the engine's RSS after a burst of long prompts stayed up,
the runner keeping each step's freed buffers for the next step).

No model: a fake engine core on inproc ZMQ sockets; the trim is counted.
"""

from __future__ import annotations

import threading
import time

import zmq

from cadence.core.outputs import EngineCoreOutputs
from cadence.engine import core_proc, wire


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(condition())


class FakeCore:
    """Has work for ``num_steps`` steps at a time; an abort message adds two more."""

    def __init__(self) -> None:
        self.num_steps = 2
        self.num_idle_steps = 0
        self.steps_taken = 0

    def has_work(self) -> bool:
        return self.num_steps > 0

    def step(self) -> dict:
        self.num_steps -= 1
        self.steps_taken += 1
        return {0: EngineCoreOutputs()}

    def take_request_errors(self) -> dict:
        return {}

    def take_runner_faults(self) -> set:
        return set()

    def abort_requests(self, request_ids: list[str]) -> None:
        self.num_steps += 2

    def finish_by_stop_string(self, request_ids: list[str]) -> None:
        pass


class FakeEngine:
    def __init__(self) -> None:
        self.core = FakeCore()


def test_an_idle_engine_returns_freed_memory_once_per_idle_period(monkeypatch):
    trims: list[int] = []
    engine = FakeEngine()
    monkeypatch.setattr(core_proc, "_IDLE_POLL_MS", 20)
    monkeypatch.setattr(core_proc, "return_freed_memory", lambda: trims.append(engine.core.steps_taken))
    context = zmq.Context()
    inputs, front = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    outputs, sink = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    inputs.bind("inproc://inputs")
    front.connect("inproc://inputs")
    sink.bind("inproc://outputs")
    outputs.connect("inproc://outputs")
    proc = core_proc.EngineCoreProc(engine, inputs, outputs)
    loop = threading.Thread(target=proc.run)
    loop.start()
    try:
        assert wait_until(lambda: trims)  # two steps, then idle polls
        time.sleep(0.2)  # ~10 more idle polls
        assert trims == [2]
        front.send_multipart(wire.encode(wire.ABORT, ["r"]))  # two more steps
        assert wait_until(lambda: len(trims) > 1)
        time.sleep(0.2)
        assert trims == [2, 4]
    finally:
        front.send_multipart([wire.SHUTDOWN, b""])
        loop.join(5)
        context.destroy(linger=0)
    assert not loop.is_alive()


def test_an_engine_that_never_stepped_does_not_trim(monkeypatch):
    trims: list[int] = []
    engine = FakeEngine()
    engine.core.num_steps = 0
    monkeypatch.setattr(core_proc, "_IDLE_POLL_MS", 20)
    monkeypatch.setattr(core_proc, "return_freed_memory", lambda: trims.append(1))
    context = zmq.Context()
    inputs, front = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inputs.bind("inproc://idle-inputs")
    front.connect("inproc://idle-inputs")
    proc = core_proc.EngineCoreProc(engine, inputs, context.socket(zmq.PUSH))
    loop = threading.Thread(target=proc.run)
    loop.start()
    time.sleep(0.15)
    front.send_multipart([wire.SHUTDOWN, b""])
    loop.join(5)
    context.destroy(linger=0)
    assert trims == [] and not loop.is_alive()
