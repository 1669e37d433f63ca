"""``cadence simulate``: compare scheduling policies on a simulated runner.

    cadence simulate --policy fcfs,priority --num-requests 2000 --rate 40 --out sim-out
    cadence simulate run --trace trace.jsonl --cost-model calibrated:cal.json
    cadence simulate --cost-model roofline:h200 --model-config path/to/config.json
    cadence simulate calibrate --out cal.json          # time the real CPU runner, fit

Scheduler, cache, workload and goodput options are generated from their
dataclasses (``SchedulerConfig``, ``CacheConfig``, ``SyntheticWorkload``,
``GoodputOptions``), and so are the engine options the simulator models
(``--kv-offload-size``, ``--data-parallel-size``, ``--dp-load-margin-tokens``):
one flag each, checked by its class. Importing this module is cheap; the
simulator, numpy, matplotlib and torch load on use.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from cadence.config import option

SUMMARY_FILE = "summary.json"
# The engine options the simulator models, generated from their classes
# (KVTransferConfig, ParallelConfig); the others of those classes it cannot run.
ENGINE_OPTIONS = ("kv_offload_size", "data_parallel_size")


@dataclasses.dataclass(frozen=True)
class GoodputOptions:
    """Goodput: the latencies a finished request must meet to count (a request that
    carries its own targets is judged by those). Not the slo policy's targets,
    which steer the scheduler (--slo-ttft-s, --slo-tpot-s)."""

    goodput_ttft_s: float = option(2.0, "Time to first token a request must meet to count in goodput (s).")
    goodput_tpot_s: float = option(0.2, "Time per output token a request must meet to count in goodput (s).")

    def __post_init__(self) -> None:
        for name in ("goodput_ttft_s", "goodput_tpot_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0 s, got {getattr(self, name)!r}")

    def slo(self) -> Any:
        """As the metrics take it (``cadence.sim.metrics.SLO``)."""
        from cadence.sim.metrics import SLO

        return SLO(ttft_s=self.goodput_ttft_s, tpot_s=self.goodput_tpot_s)


def add_simulate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``simulate`` (actions: run, the default, and calibrate)."""
    sim = subparsers.add_parser(
        "simulate", help="simulate serving: the real scheduler on a cost-model runner",
        description=__doc__.split("\n\n")[0], conflict_handler="resolve",
        allow_abbrev=False,  # an old flag (--slo-ttft) must fail, not abbreviate another (--slo-ttft-s)
    )
    _add_run_options(sim)
    sim.set_defaults(func=cmd_run)
    actions = sim.add_subparsers(dest="sim_action", metavar="{run,calibrate}")
    run = actions.add_parser("run", help="simulate a workload under one or more policies (default)",
                             conflict_handler="resolve", allow_abbrev=False)
    _add_run_options(run)
    run.set_defaults(func=cmd_run)
    calibrate = actions.add_parser("calibrate", help="time the real CPU runner and fit a cost model")
    _add_calibrate_options(calibrate)
    calibrate.set_defaults(func=cmd_calibrate)
    return sim


def _config_classes() -> tuple[type, ...]:
    from cadence.config import CacheConfig, SchedulerConfig
    from cadence.sim.workload import SyntheticWorkload

    return SchedulerConfig, CacheConfig, SyntheticWorkload


def _engine_classes() -> tuple[type, ...]:
    """The classes of ``ENGINE_OPTIONS``."""
    from cadence.config import KVTransferConfig, ParallelConfig

    return KVTransferConfig, ParallelConfig


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    from cadence.config_cli import add_config_options

    add_config_options(parser, (*_config_classes(), GoodputOptions))
    add_config_options(parser, _engine_classes(), only=ENGINE_OPTIONS)
    # Replaces SchedulerConfig's generated --policy: here it takes a list.
    parser.add_argument("--policy", dest="policies", default="fcfs",
                        help="scheduling policies to compare, comma separated (default: fcfs)")
    parser.add_argument("--trace", metavar="PATH",
                        help="replay this JSONL trace instead of a synthetic workload")
    parser.add_argument("--save-trace", metavar="PATH", help="write the workload as a JSONL trace")
    parser.add_argument("--cost-model", default="roofline:h100",
                        help="roofline:h100|roofline:h200|roofline:cpu or calibrated:PATH "
                             "(default: roofline:h100)")
    parser.add_argument("--model-config", metavar="NAME|PATH",
                        help="HF config.json (or its folder), or llama-3-8b / smollm2-135m "
                             "(default: llama-3-8b on GPUs, smollm2-135m on the CPU)")
    parser.add_argument("--charge-host-time", action="store_true",
                        help="charge the engine loop's measured seconds per step on the virtual clock "
                             "(the host's share: added to the model's time, or overlapped with it "
                             "under --async-scheduling)")
    parser.add_argument("--copy-link", default="pcie", choices=("pcie", "nvlink"),
                        help="with --kv-offload-size: the tier's link, its copies charged at its "
                             "bandwidth: pcie (32 GB/s) or nvlink (NVLink-C2C, 450 GB/s)")
    parser.add_argument("--out", metavar="DIR", help=f"write {SUMMARY_FILE} and PNG plots here")
    _add_data_parallel_options(parser)
    _add_disaggregation_options(parser)


def _add_data_parallel_options(parser: argparse.ArgumentParser) -> None:
    from cadence.config import RouterConfig
    from cadence.config_cli import add_config_options

    add_config_options(parser, (RouterConfig,))  # --dp-load-margin-tokens
    # Replaces RouterConfig's generated --dp-routing: here it takes a list.
    parser.add_argument("--dp-routing", dest="dp_routings", default="cache_aware",
                        help="with --data-parallel-size > 1: routing policies to compare, comma "
                             "separated: round_robin, least_loaded, cache_aware (default: cache_aware)")
    parser.add_argument("--parallel-replicas", action="store_true",
                        help="with --data-parallel-size > 1: run the replicas in parallel processes, "
                             "the same results (round_robin routing only: the others read every "
                             "replica's state at each arrival)")


def _add_disaggregation_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill-decode", metavar="P,D", default=None,
                        help="prefill/decode disaggregation: P prefill and D decode replicas (the "
                             "PDConnector's scheduler side, each pull priced on --pd-link), beside "
                             "P+D data-parallel replicas; routing from --dp-routing (one policy)")
    parser.add_argument("--pd-link", dest="pd_links", default="pcie",
                        help="with --prefill-decode: links to compare, comma separated: "
                             "pcie, nvlink, ethernet-100g, rdma-400g (default: pcie)")
    parser.add_argument("--pd-transfer-latency", type=float, default=0.0, metavar="S",
                        help="with --prefill-decode: fixed seconds added to each pull (default: 0)")


def _add_calibrate_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="calibration.json", metavar="PATH",
                        help="where to write the fitted model (default: calibration.json)")
    parser.add_argument("--model", default=None, help="GGUF or HF folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--token-curve", action=argparse.BooleanOptionalAction, default=True,
                        help="fit step time as a piecewise-linear curve of the token count (default), "
                             "or a line a + b*tokens")
    parser.add_argument("--features", default=None,
                        help="linear terms beside it: seqs, kv_tokens, attn_pairs, and tokens without "
                             "the curve (default: seqs,kv_tokens; tokens,seqs,kv_tokens without the curve)")
    parser.add_argument("--quick", action="store_true", help="fewer batch shapes (a quick check)")


# ---------------------------------------------------------------- run


def cmd_run(args: argparse.Namespace) -> int:
    from cadence.config_cli import options_of
    from cadence.config import POLICY_OPTIONS, EngineOptions
    from cadence.sim.cost_model import make_cost_model
    from cadence.sim.simulator import compare_policies
    from cadence.sim.workload import SyntheticWorkload, read_trace, write_trace

    scheduler_cls, cache_cls, workload_cls = _config_classes()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    kwargs = options_of(args, (scheduler_cls, cache_cls, *_engine_classes()))
    # Each policy's own options (fair's weights, slo's targets) go to its run only.
    per_policy = {policy: {name: kwargs.pop(name) for name in names if name in kwargs}
                  for policy, names in POLICY_OPTIONS.items()}
    for policy, own in per_policy.items():
        if any(own.values()) and policy not in policies:
            name = next(name for name, value in own.items() if value)
            raise ValueError(f"{name}: applies to policy {policy} only, which --policy does not run")
    options = EngineOptions.from_kwargs(**kwargs)
    goodput = GoodputOptions(**options_of(args, (GoodputOptions,)))
    num_replicas = options.parallel.data_parallel_size
    kv_tier = None
    if options.kv_transfer is not None:
        from cadence.sim.kv_tier import SimKVTier

        kv_tier = SimKVTier(options.kv_transfer.kv_offload_size, args.copy_link, options.preemption_mode)
    policy_options = {policy: {k: v for k, v in own.items() if v is not None}
                      for policy, own in per_policy.items()}
    if options.cache.enable_kv_cache_events:
        raise ValueError("enable_kv_cache_events: not supported yet by the simulator "
                         "(it would record events and publish none)")
    if args.trace:
        specs = read_trace(args.trace)
        workload: dict[str, Any] = {"trace": args.trace}
    else:
        synthetic = SyntheticWorkload(**options_of(args, (workload_cls,)))
        specs = synthetic.generate()
        workload = {"synthetic": vars_of(synthetic)}
    if args.save_trace:
        write_trace(args.save_trace, specs)
    cost_model = make_cost_model(args.cost_model, args.model_config)
    if args.parallel_replicas and (num_replicas < 2 or args.prefill_decode is not None):
        raise ValueError("parallel_replicas: runs the replicas of --data-parallel-size > 1 "
                         "(not with --prefill-decode)")
    if args.prefill_decode is not None:
        if num_replicas > 1 or kv_tier is not None:
            raise ValueError("prefill_decode: combines with neither --data-parallel-size nor "
                             "--kv-offload-size in the simulator")
        results, per_replica = _simulate_pd(args, specs, policies, options, cost_model,
                                            policy_options), {}
    elif num_replicas > 1:
        if kv_tier is not None:
            raise ValueError("kv_offload_size: not supported yet with --data-parallel-size > 1 "
                             "in the simulator")
        results, per_replica = _simulate_replicas(args, specs, policies, options, cost_model,
                                                  policy_options)
    else:
        results, per_replica = compare_policies(
            specs, policies, options.scheduler, options.cache, cost_model,
            policy_options=policy_options, charge_host_time=args.charge_host_time,
            kv_tier=kv_tier), {}
    slo = goodput.slo()
    # Jain's index weighs each client's service by its fair share, for every policy alike.
    weights = _client_index_weights(policy_options["fair"].get("fair_client_weights"))
    summaries = {policy: result.summary(slo, weights) for policy, result in results.items()}
    for label, counts in per_replica.items():
        summaries[label]["requests_per_replica"] = counts
    print(format_table(summaries))
    if args.out:
        from cadence.sim.plots import write_plots

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        document = {
            "workload": workload,
            "cost_model": cost_model.describe(),
            "scheduler": vars_of(options.scheduler),
            "data_parallel_size": num_replicas,
            "prefill_decode": args.prefill_decode,
            "cache": vars_of(_cache_of(cost_model, options.cache,
                                       groups=kv_tier is None and args.prefill_decode is None)),
            "policies": summaries,
        }
        (out / SUMMARY_FILE).write_text(json.dumps(document, indent=2) + "\n")
        paths = write_plots({p: r.recorder for p, r in results.items()}, out)
        print(f"wrote {out / SUMMARY_FILE}, " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


def _simulate_replicas(args: argparse.Namespace, specs: list, policies: list[str], options: Any,
                       cost_model: Any, policy_options: dict[str, dict[str, Any]],
                       ) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """``--data-parallel-size N``: each routing policy on N replicas (one scheduling policy)."""
    from cadence.config import RouterConfig
    from cadence.config_cli import options_of
    from cadence.sim.replicas import compare_routing

    if len(policies) != 1:
        raise ValueError("policy: with data_parallel_size > 1 the runs compare routing "
                         "policies; give one scheduling policy")
    margin = RouterConfig(**options_of(args, (RouterConfig,))).dp_load_margin_tokens
    routings = [r.strip() for r in args.dp_routings.split(",") if r.strip()]
    for routing in routings:  # each refused as the server refuses it
        RouterConfig(dp_routing=routing)
    if args.parallel_replicas:
        from cadence.sim.replica_pool import PARALLEL_ROUTINGS

        shared = [routing for routing in routings if routing not in PARALLEL_ROUTINGS]
        if shared:
            raise ValueError(f"parallel_replicas: routing {', '.join(shared)} reads every replica's "
                             f"state at each arrival; only {', '.join(PARALLEL_ROUTINGS)} runs apart")
    scheduler = dataclasses.replace(options.scheduler, policy=policies[0],
                                    **policy_options.get(policies[0], {}))
    runs = compare_routing(specs, routings, options.parallel.data_parallel_size, scheduler, options.cache,
                           cost_model, load_margin_tokens=margin,
                           charge_host_time=args.charge_host_time,
                           parallel_replicas=args.parallel_replicas)
    return ({label: run for label, (run, _) in runs.items()},
            {label: counts for label, (_, counts) in runs.items()})


def _simulate_pd(args: argparse.Namespace, specs: list, policies: list[str], options: Any,
                 cost_model: Any, policy_options: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``--prefill-decode P,D``: P+D data-parallel replicas, then P prefill and D
    decode replicas over each link."""
    from cadence.config import RouterConfig
    from cadence.config_cli import options_of
    from cadence.sim.disaggregation import compare_pd

    sizes = args.prefill_decode.split(",")
    if len(sizes) != 2 or not all(size.strip().isdigit() and int(size) >= 1 for size in sizes):
        raise ValueError(f"prefill_decode: must be P,D (two integers >= 1), got {args.prefill_decode!r}")
    if not args.pd_transfer_latency >= 0:
        raise ValueError(f"pd_transfer_latency: must be >= 0 s, got {args.pd_transfer_latency!r}")
    if len(policies) != 1:
        raise ValueError("policy: with prefill_decode the runs compare links; give one scheduling policy")
    routings = [r.strip() for r in args.dp_routings.split(",") if r.strip()]
    if len(routings) != 1:
        raise ValueError("dp_routing: with prefill_decode give one routing policy")
    router = RouterConfig(**{**options_of(args, (RouterConfig,)), "dp_routing": routings[0]})
    scheduler = dataclasses.replace(options.scheduler, policy=policies[0],
                                    **policy_options.get(policies[0], {}))
    return compare_pd(specs, int(sizes[0]), int(sizes[1]), [link.strip() for link in args.pd_links.split(",")],
                      scheduler, options.cache, cost_model, routing=router.dp_routing,
                      transfer_latency_s=args.pd_transfer_latency,
                      load_margin_tokens=router.dp_load_margin_tokens, charge_host_time=args.charge_host_time)


def _cache_of(cost_model: Any, cache: Any, *, groups: bool) -> Any:
    """The cache config as simulated (blocks sized by the cost model when unset, for the
    cache's width and, where ``groups`` (no KV connector), the engine's KV cache groups)."""
    import dataclasses

    if cache.num_gpu_blocks is None:
        if hasattr(cost_model, "with_kv_cache"):
            cost_model = cost_model.with_kv_cache(cache.kv_cache_dtype, cache.kv_cache_groups and groups)
        cache = dataclasses.replace(cache, num_gpu_blocks=cost_model.num_kv_blocks(cache.block_size))
    return cache


def vars_of(obj: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(obj)


ROWS = (
    ("output tok/s", ("throughput", "output_tokens_per_s"), "{:.1f}"),
    ("requests/s", ("throughput", "requests_per_s"), "{:.2f}"),
    ("goodput req/s", ("goodput", "requests_per_s"), "{:.2f}"),
    ("SLO met", ("goodput", "fraction"), "{:.1%}"),
    ("TTFT p50 (s)", ("ttft_s", "p50"), "{:.3f}"),
    ("TTFT p99 (s)", ("ttft_s", "p99"), "{:.3f}"),
    ("TPOT p50 (s)", ("tpot_s", "p50"), "{:.4f}"),
    ("TPOT p99 (s)", ("tpot_s", "p99"), "{:.4f}"),
    ("ITL p99 (s)", ("itl_s", "p99"), "{:.4f}"),
    ("E2E p50 (s)", ("e2e_s", "p50"), "{:.3f}"),
    ("preemptions", ("preemptions",), "{}"),
    ("pulls (s on links)", ("transfers", "seconds"), "{:.2f}"),
    ("prefix hit rate", ("prefix_hit_rate",), "{:.1%}"),
    ("Jain, backlogged", ("jain_index_backlogged",), "{:.3f}"),
    ("finished", ("num_finished",), "{}"),
    ("rejected", ("num_rejected",), "{}"),
    ("simulated s", ("clock_s",), "{:.1f}"),
    ("wall s", ("sim_wall_s",), "{:.2f}"),
)


def _client_index_weights(text: str | None) -> dict[int, float]:
    """``client0=2,client1=1`` (the simulator's client names) -> {0: 2.0, 1: 1.0}."""
    from cadence.core.sched.fair import parse_client_weights

    weights = {}
    for name, weight in parse_client_weights(text).items():
        if name is not None and name.startswith("client") and name[6:].isdigit():
            weights[int(name[6:])] = weight
    return weights


def format_table(summaries: dict[str, dict[str, Any]]) -> str:
    """Metrics as rows, one column per policy."""
    labels = list(summaries)
    cells = [["metric", *labels]]
    for name, path, fmt in ROWS:
        row = [name]
        for label in labels:
            value: Any = summaries[label]
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
            row.append("-" if value is None else fmt.format(value))
        cells.append(row)
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---------------------------------------------------------------- calibrate


def cmd_calibrate(args: argparse.Namespace) -> int:
    from cadence.sim.calibrate import CURVE_FEATURES, build_default_engine, calibrate, default_scenarios
    from cadence.sim.cost_model import DEFAULT_FEATURES, DEFAULT_TOKEN_KNOTS

    if args.features is None:
        features = list(CURVE_FEATURES if args.token_curve else DEFAULT_FEATURES)
    else:
        features = [f.strip() for f in args.features.split(",") if f.strip()]
    engine = build_default_engine(dtype=args.dtype, num_threads=args.num_threads, model=args.model)
    model = calibrate(engine, scenarios=default_scenarios(args.quick), features=features,
                      token_knots=DEFAULT_TOKEN_KNOTS if args.token_curve else None,
                      log=lambda line: print(line, file=sys.stderr))
    model.save(args.out)
    print(f"wrote {args.out}")
    return 0
