"""Engine-core replicas as Ray actors (``--distributed-executor-backend ray``).

Ray places and supervises; the messages are the same as with local
processes (``cadence.engine.wire`` over ZeroMQ), on TCP: each actor runs the
engine-core loop and connects to the sockets the front end bound on its
node's address.

    front end (driver) ──ray.init──► the Ray cluster
        EngineCoreActor.options(SPREAD).remote()   one per replica, on any node
        actor.run(options, input, output, ...)      the engine loop, until shutdown

The cluster: ``RAY_ADDRESS`` (e.g. ``ray://head:10001`` or ``head:6379``),
else one started on this machine by ``ray start --head``, else a local Ray
started here for the server's lifetime (and stopped with it).

``RayEngineHandle`` gives ``AsyncLLM`` what it needs of an engine process (a
sentinel that turns readable when the engine ends, ``is_alive``, ``join``,
``kill``, ``exitcode``, ``pid``), so a dead actor fails its replica's
requests exactly as a dead process does. Ray is imported here only.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from cadence.config import EngineOptions

logger = logging.getLogger("cadence.ray")
LOCAL_OBJECT_STORE_BYTES = 256 * 2**20  # the engines pass nothing through it


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend: ray is not installed "
                         "(pip install 'cadence[ray]')") from None
    return ray


class EngineCoreActor:
    """The engine-core loop inside a Ray actor."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, options: EngineOptions, input_address: str, output_address: str,
            model_name: str, rank: int) -> int:
        from cadence.engine.core_proc import run_engine_core

        try:
            run_engine_core(options, input_address, output_address, model_name, dp_rank=rank,
                            own_signals=False)
        except SystemExit as exit:  # a failed start or step, reported to the front end already
            return exit.code if isinstance(exit.code, int) else 1
        return 0


class RayEngineHandle:
    """A running actor, seen as a ``multiprocessing.Process`` (see the module docstring)."""

    def __init__(self, ray: Any, actor: Any, pid_ref: Any, run_ref: Any) -> None:
        self._ray = ray
        self.actor = actor
        self._pid_ref = pid_ref
        self._run_ref = run_ref
        self.exitcode: int | None = None
        self.error: str | None = None
        self._done = threading.Event()
        self.sentinel, self._write_fd = os.pipe()
        threading.Thread(target=self._watch, name="cadence-ray-watch", daemon=True).start()

    def _watch(self) -> None:
        try:
            self.exitcode = self._ray.get(self._run_ref)
        except Exception as err:  # the actor died (killed, its node lost, out of memory)
            self.exitcode, self.error = 1, f"{type(err).__name__}: {err}".splitlines()[0]
            logger.error("cadence: engine actor ended: %s", self.error)
        self._done.set()
        os.write(self._write_fd, b"x")

    @property
    def pid(self) -> int:
        return self._ray.get(self._pid_ref)

    def is_alive(self) -> bool:
        return not self._done.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def kill(self) -> None:
        self._ray.kill(self.actor, no_restart=True)

    def close(self) -> None:
        if self.is_alive():
            self.kill()
            self.join(5.0)
        for fd in (self.sentinel, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass


class RayEngines:
    """The Ray connection and the engine actors of one front end."""

    def __init__(self, options: EngineOptions) -> None:
        self._ray = ray = _import_ray()
        self.num_cpus = options.engine.num_threads or 1
        self._started_ray = False
        if not ray.is_initialized():
            self._started_ray = self._connect(options.parallel.data_parallel_size * self.num_cpus)
        self.node_ip = ray.util.get_node_ip_address()
        self.num_gpus = self._gpus_per_actor(options.engine.device)
        self._actor_class = ray.remote(EngineCoreActor)
        self.handles: list[RayEngineHandle] = []

    def _gpus_per_actor(self, device: str) -> int:
        """1 with device cuda (or auto on a cluster with GPUs): Ray gives each actor
        its own GPU (CUDA_VISIBLE_DEVICES) on whichever node it places it."""
        if device == "cuda":
            return 1
        return int(device == "auto" and self._ray.cluster_resources().get("GPU", 0) > 0)

    def _connect(self, num_cpus_needed: int) -> bool:
        """Join ``RAY_ADDRESS`` or a running cluster; else start a local Ray (True)."""
        ray, address = self._ray, os.environ.get("RAY_ADDRESS")
        if address and address != "local":
            ray.init(address=address, logging_level=logging.WARNING)
            return False
        if address is None:
            try:
                ray.init(address="auto", logging_level=logging.WARNING)
                return False
            except ConnectionError:
                pass
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, num_cpus_needed),
                 object_store_memory=LOCAL_OBJECT_STORE_BYTES, include_dashboard=False,
                 logging_level=logging.WARNING)
        return True

    def start(self, rank: int, options: EngineOptions, input_address: str, output_address: str,
              model_name: str) -> RayEngineHandle:
        actor = self._actor_class.options(
            num_cpus=self.num_cpus, num_gpus=self.num_gpus, name=f"cadence-engine-core-{rank}-{os.getpid()}",
            scheduling_strategy="SPREAD", max_restarts=0).remote()
        pid_ref = actor.pid.remote()  # before run: an actor runs its calls in order
        run_ref = actor.run.remote(options, input_address, output_address, model_name, rank)
        handle = RayEngineHandle(self._ray, actor, pid_ref, run_ref)
        self.handles.append(handle)
        return handle

    def shutdown(self) -> None:
        for handle in self.handles:
            handle.close()
        if self._started_ray:
            self._ray.shutdown()
