"""Simulated serving: the real scheduler on a cost-model runner and a virtual clock.

    specs = SyntheticWorkload(num_requests=1000, rate=20).generate()
    result = Simulator(SchedulerConfig(), CacheConfig(), make_cost_model("roofline:h100")).run(specs)
    print(result.summary()["ttft_s"])

Modules: ``runner`` (``SimRunner``), ``simulator`` (the clock and the loop),
``cost_model`` (roofline, calibrated, hardware profiles), ``calibrate``
(timing the real CPU runner), ``workload`` (synthetic and JSONL traces),
``metrics``, ``plots``, ``cli`` (``cadence simulate``).

Names load on first use: ``cadence.cli`` imports ``cadence.sim.cli`` for
every command, and the simulator pulls in the engine (and with it torch).
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "PROFILES": "cost_model", "CalibratedCostModel": "cost_model", "HardwareProfile": "cost_model",
    "ModelShape": "cost_model", "RooflineCostModel": "cost_model", "StepShape": "cost_model",
    "TokenCurve": "cost_model", "make_cost_model": "cost_model",
    "SLO": "metrics", "MetricsRecorder": "metrics", "summarize": "metrics",
    "SimRunner": "runner",
    "SimResult": "simulator", "Simulator": "simulator", "SimulationStalled": "simulator",
    "compare_policies": "simulator",
    "PromptMaker": "workload", "RequestSpec": "workload", "SyntheticWorkload": "workload",
    "read_trace": "workload", "write_trace": "workload",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cadence.sim' has no attribute {name!r}")
    return getattr(import_module(f"cadence.sim.{module}"), name)
