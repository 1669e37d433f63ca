"""Simulated serving: the real scheduler on a cost-model runner and a virtual clock.

    specs = SyntheticWorkload(num_requests=1000, rate=20).generate()
    result = Simulator(SchedulerConfig(), CacheConfig(), make_cost_model("roofline:h100")).run(specs)
    print(result.summary()["ttft_s"])

Modules: ``runner`` (``SimRunner``), ``simulator`` (the clock and the loop),
``cost_model`` (roofline, calibrated, hardware profiles), ``calibrate``
(timing the real CPU runner), ``workload`` (synthetic and JSONL traces),
``metrics``, ``plots``, ``cli`` (``cadence simulate``), ``replicas`` (data-parallel
replicas behind the router), ``disaggregation`` (prefill and decode replicas, the
prompt's KV pulled over a link: ``PDFleet``, ``compare_pd``).

Names load on first use: ``cadence.cli`` imports ``cadence.sim.cli`` for
every command, and importing this package must stay cheap. The simulator
itself never loads torch (``tests/sim/test_sim_layering.py``).
"""

from cadence._lazy import lazy_exports

_MODULES = {
    "disaggregation": ("PDFleet", "compare_pd"),
    "cost_model": ("PROFILES", "CalibratedCostModel", "HardwareProfile", "ModelShape",
                   "RooflineCostModel", "StepShape", "TokenCurve", "make_cost_model"),
    "metrics": ("SLO", "MetricsRecorder", "summarize"),
    "runner": ("SimRunner",),
    "simulator": ("SimResult", "Simulator", "SimulationStalled", "compare_policies"),
    "workload": ("PromptMaker", "RequestSpec", "SyntheticWorkload", "read_trace", "write_trace"),
}
_EXPORTS = {name: f"cadence.sim.{module}" for module, names in _MODULES.items() for name in names}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
