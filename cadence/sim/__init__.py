"""Simulated serving: the real scheduler on a cost-model runner and a virtual clock.

    specs = SyntheticWorkload(num_requests=1000, rate=20).generate()
    result = Simulator(SchedulerConfig(), CacheConfig(), make_cost_model("roofline:h100")).run(specs)
    print(result.summary()["ttft_s"])

Modules: ``runner`` (``SimRunner``), ``simulator`` (the clock and the loop),
``cost_model`` (roofline, calibrated, hardware profiles), ``calibrate``
(timing the real CPU runner), ``workload`` (synthetic and JSONL traces),
``metrics``, ``plots``, ``cli`` (``cadence simulate``).
"""

from cadence.sim.cost_model import (
    PROFILES,
    CalibratedCostModel,
    HardwareProfile,
    ModelShape,
    RooflineCostModel,
    StepShape,
    make_cost_model,
)
from cadence.sim.metrics import SLO, MetricsRecorder, summarize
from cadence.sim.runner import SimRunner
from cadence.sim.simulator import SimResult, Simulator, SimulationStalled, compare_policies
from cadence.sim.workload import PromptMaker, RequestSpec, SyntheticWorkload, read_trace, write_trace

__all__ = [
    "PROFILES", "SLO", "CalibratedCostModel", "HardwareProfile", "MetricsRecorder", "ModelShape",
    "PromptMaker", "RequestSpec", "RooflineCostModel", "SimResult", "SimRunner", "SimulationStalled",
    "Simulator", "StepShape", "SyntheticWorkload", "compare_policies", "make_cost_model",
    "read_trace", "summarize", "write_trace",
]
