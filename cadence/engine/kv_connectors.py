"""KV connectors by name: each registered name is a pair of classes, the
scheduler side (pure Python, ``cadence.core``) and the worker side (the
runner's), imported only when a connector of that name is built.

A new connector adds one line to ``_CONNECTORS`` (or calls
``register_kv_connector``). Each class is built as ``cls(config, context)``
with the engine's ``KVTransferConfig`` and ``KVConnectorContext``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Callable

from cadence.config import KVTransferConfig

if TYPE_CHECKING:
    from cadence.core.sched.kv_connector import KVConnectorBase, KVConnectorContext
    from cadence.runner.kv_transfer.base import KVConnectorWorker

# name -> ("module:SchedulerClass", "module:WorkerClass")
_CONNECTORS: dict[str, tuple[str, str]] = {
    "OffloadingConnector": ("cadence.core.kv_transfer.offloading:OffloadingConnector",
                            "cadence.runner.kv_transfer.offloading:OffloadingWorker"),
    # Prefill/decode disaggregation: a decode engine pulls a prefill engine's KV.
    "PDConnector": ("cadence.core.kv_transfer.pd_connector:PDConnectorScheduler",
                    "cadence.runner.kv_transfer.pd_worker:PDConnectorWorker"),
}


def register_kv_connector(name: str, scheduler_class: str, worker_class: str) -> None:
    """Make ``name`` a connector: two ``"module:Class"`` paths."""
    _CONNECTORS[name] = (scheduler_class, worker_class)


def registered_kv_connectors() -> list[str]:
    return sorted(_CONNECTORS)


def make_kv_connector_scheduler(config: KVTransferConfig, context: "KVConnectorContext") -> "KVConnectorBase":
    """The scheduler side of the named connector (ValueError naming kv_connector if unknown)."""
    return _load(config, 0)(config, context)


def make_kv_connector_worker(config: KVTransferConfig, context: "KVConnectorContext") -> "KVConnectorWorker":
    """The worker side of the named connector, for the model runner."""
    return _load(config, 1)(config, context)


def kv_transfer_params_checker(config: KVTransferConfig | None) -> Callable[[Any], None] | None:
    """How this engine's connector checks a request's ``kv_transfer_params``
    (raising ValueError naming the field), or None when it reads none: the
    scheduler class's ``check_kv_transfer_params(params, config)``, if it has one.
    Imports only the scheduler side (pure Python): a front end can call it."""
    if config is None:
        return None
    check = getattr(_load(config, 0), "check_kv_transfer_params", None)
    if check is None:
        return None
    return lambda params: check(params, config)


def _load(config: KVTransferConfig, side: int) -> type:
    paths = _CONNECTORS.get(config.kv_connector or "")
    if paths is None:
        raise ValueError(f"kv_connector: unknown connector {config.kv_connector!r} "
                         f"(registered: {', '.join(registered_kv_connectors())})")
    module_name, _, class_name = paths[side].partition(":")
    return getattr(importlib.import_module(module_name), class_name)
