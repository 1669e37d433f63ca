#!/usr/bin/env python3
"""End-to-end generation throughput: workload ``cpu-throughput-v1``.

Defined in ../shared/workloads/README.md: the default model
(SmolLM2-135M-Instruct, Q4_1 GGUF) in fp32 and bf16; the 64 chat prompts of
``cpu-throughput-v1.json`` through the model's chat template; greedy,
exactly 128 new tokens each (EOS ignored); all submitted at once; 2 threads.
Figure: output tokens/s from submit to last token, and peak RSS.

Systems, each in its own subprocess (so peak RSS is its own):

    cadence     cadence.LLM(dtype=...).generate(...), KV cache sized to the workload
    hf-static   transformers ``generate`` on one left-padded batch
    hf-cb       transformers continuous batching (``generate_batch``, with an
                explicit ContinuousBatchingConfig: on CPU its defaults reserve
                most of the RAM)
    roofline    this machine's bandwidth and GEMM FLOP/s -> the workload's bound
                (see roofline.py)

Only what this CPU can do is measured, and the report says what was left
out and why. A dtype the CPU computes only in software (bfloat16 without
AVX512_BF16, AMX or ARM BF16, see ``cadence.cpu_features``) is skipped, in
every system and in the roofline's GEMM, unless ``--include-emulated`` asks
for it; then its rows are marked "emulated" and its GEMM is timed on a small
matrix (an AVX2 EPYC emulates bfloat16 at ~1 GFLOP/s: the 4096-square GEMM
took minutes a product). The packed oneDNN GEMM is timed only where oneDNN
packs that dtype here. A child that fails, or runs past ``--timeout``, is a
row saying "failed: <the last line of its stderr>"; the rest still runs.
``CADENCE_HIDE_CPU_FEATURES`` (e.g. ``avx512,amx`` or ``onednn``) reaches the
children, so a machine can be measured as a lesser one.

Every system gets the same prompt token ids (checked against the ids stored
in the workload file), runs one small warm-up generation on unrelated ids,
then the timed one; every prompt must get exactly max_tokens tokens.

The machine may be shared, and two threads on two cores slow down several
times over when another process is busy (every OpenMP barrier waits for a
descheduled thread). So each run starts after a quiet moment, measures the
cores other processes used meanwhile ("other procs"), and is run again when
that exceeds --max-others; the table lists every run.

    python bench/throughput.py                             # the whole table (minutes)
    python bench/throughput.py --quick                     # 8 prompts x 32 tokens
    python bench/throughput.py --systems cadence,roofline --dtypes bfloat16
    python bench/throughput.py --dtypes bfloat16 --include-emulated   # bf16 on an AVX2-only CPU
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

WORKLOAD = "cpu-throughput-v1"
WORKLOAD_FILE = Path(__file__).resolve().parents[2] / "shared" / "workloads" / f"{WORKLOAD}.json"
SYSTEMS = ("cadence", "hf-static", "hf-cb", "roofline")
DTYPES = ("float32", "bfloat16")
NUM_THREADS = 2
MAX_TOKENS = 128
QUICK_PROMPTS, QUICK_TOKENS = 8, 32
# Step token budget: every prompt prefills in one step (64 prompts < 3,000 tokens).
MAX_BATCHED_TOKENS = 4096
KV_BLOCK_SIZE = 16  # cadence's
HF_PAGE_SIZE = 256  # transformers continuous batching's default page
WARMUP_PROMPTS = [list(range(1000, 1040)), list(range(2000, 2030))]  # no shared prefix with the workload
WARMUP_TOKENS = 4
RESULT_MARK = "RESULT "
# Two threads on two cores: another busy process stalls every OpenMP barrier.
QUIET_CORES = 0.25
QUIET_WINDOW_S = 3.0
CHILD_TIMEOUT_S = 1800.0  # the whole table's slowest child (hf-static fp32) takes a few minutes


@dataclass(frozen=True)
class Job:
    """What a child process runs: one system in one dtype on these prompts
    (the roofline: the GEMM of each of ``gemm_dtypes``)."""

    system: str
    dtype: str
    prompt_ids: list[list[int]]
    max_tokens: int
    model_path: str
    gemm_dtypes: list[str] = field(default_factory=list)


class RunFailed(RuntimeError):
    """A child that exited non-zero, printed no result, ran too long, or got the wrong tokens."""


# ==================================================================== children


def run_child(system: str, dtype: str) -> None:
    """Child side: read the Job from stdin, run it, print one RESULT line."""
    job = Job(**json.loads(sys.stdin.read()))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    torch.set_num_threads(NUM_THREADS)
    result = CHILD_RUNNERS[system](job)
    result["peak_rss_mib"] = _peak_rss_mib()
    print(RESULT_MARK + json.dumps(result), flush=True)


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _busy_cpu_seconds() -> float:
    """Seconds all CPUs of the machine spent busy (user, system, irq, steal...)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class CpuWatch:
    """Wall time, this process's CPU time, and what other processes took meanwhile.

    ``others_cores``: CPU cores other processes kept busy (load from other
    work on the machine, measured rather than assumed).
    """

    def __init__(self) -> None:
        self.busy0, self.own0, self.start = _busy_cpu_seconds(), _own_cpu_seconds(), time.perf_counter()

    def read(self) -> dict:
        wall = time.perf_counter() - self.start
        own = _own_cpu_seconds() - self.own0
        others = max(0.0, _busy_cpu_seconds() - self.busy0 - own)
        return {"wall_s": wall, "cpu_util": own / wall, "others_cores": others / wall}


def timed(run) -> dict:
    """Run ``run()`` (which returns per-prompt token counts) and measure it."""
    watch = CpuWatch()
    counts = run()
    figures = watch.read()
    return {
        **figures,
        "token_counts": counts,
        "num_tokens": sum(counts),
        "tok_s": sum(counts) / figures["wall_s"],
        "loadavg_1m": os.getloadavg()[0],
    }


def run_cadence(job: Job) -> dict:
    # cadence.engine.llm, not ``cadence.LLM``: run from outside the repository
    # root, the editable install resolves ``cadence`` as a namespace package.
    from cadence.engine.llm import LLM
    from cadence.sampling_params import SamplingParams

    start = time.perf_counter()
    llm = LLM(
        job.model_path,
        dtype=job.dtype,
        num_threads=NUM_THREADS,
        max_num_seqs=len(job.prompt_ids),
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        num_gpu_blocks=_cadence_blocks(job),
    )
    load_s = time.perf_counter() - start

    def generate(prompt_ids: list[list[int]], max_tokens: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [len(out.outputs[0].token_ids) for out in outputs]

    generate(WARMUP_PROMPTS, WARMUP_TOKENS)
    return {"load_s": load_s, **timed(lambda: generate(job.prompt_ids, job.max_tokens))}


def _cadence_blocks(job: Job) -> int:
    """KV blocks for every sequence at full length, plus the warm-up's."""
    per_seq = lambda n: -(-(n + job.max_tokens) // KV_BLOCK_SIZE)  # noqa: E731
    return sum(per_seq(len(p)) for p in job.prompt_ids + WARMUP_PROMPTS)


def load_transformers_model(path: str, dtype_name: str):
    """transformers' model for the same GGUF, in ``dtype_name``.

    As tests/models/test_smollm2_parity.py does: ``from_pretrained(gguf_file=)``
    needs ``accelerate``; without it the model is built from the GGUF's config
    and given transformers' own GGUF conversion of the tensors.
    """
    import importlib.util

    import torch
    import transformers

    dtype = getattr(torch, dtype_name)
    folder, name = os.path.split(path)
    if importlib.util.find_spec("accelerate") is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
        return model.eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    del tensors
    model.tie_weights()
    return model.eval()


def _no_eos(model) -> int:
    """Drop EOS from the model's generation config; the id to pad with."""
    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id
    model.generation_config.eos_token_id = None
    if pad is None:
        pad = eos[0] if isinstance(eos, list) else (eos if eos is not None else 0)
    model.generation_config.pad_token_id = pad
    return pad


def run_hf_static(job: Job) -> dict:
    import torch

    start = time.perf_counter()
    model = load_transformers_model(job.model_path, job.dtype)
    pad_id = _no_eos(model)
    load_s = time.perf_counter() - start

    def generate(prompt_ids: list[list[int]], max_tokens: int) -> list[int]:
        width = max(len(p) for p in prompt_ids)
        # Left padding: every prompt ends at the last column, where generation starts.
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompt_ids])  # [B, W]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])  # [B, W]
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids, attention_mask=mask, do_sample=False,
                max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=pad_id,
            )  # [B, W + max_tokens]
        new = out[:, width:]
        return [int(new.shape[1])] * new.shape[0]

    generate(WARMUP_PROMPTS, WARMUP_TOKENS)
    return {"load_s": load_s, **timed(lambda: generate(job.prompt_ids, job.max_tokens))}


def run_hf_cb(job: Job) -> dict:
    import transformers
    from transformers import ContinuousBatchingConfig, GenerationConfig

    transformers.logging.set_verbosity_error()
    start = time.perf_counter()
    model = load_transformers_model(job.model_path, job.dtype)
    pad_id = _no_eos(model)
    load_s = time.perf_counter() - start
    longest = max(len(p) for p in job.prompt_ids) + job.max_tokens
    pages_per_seq = -(-longest // HF_PAGE_SIZE)
    # Explicit sizes: on CPU the defaults reserve most of the machine's RAM.
    cb_config = ContinuousBatchingConfig(
        num_blocks=pages_per_seq * len(job.prompt_ids) + 2,
        max_batch_tokens=MAX_BATCHED_TOKENS,
        max_requests_per_batch=len(job.prompt_ids),
    )

    def generate(prompt_ids: list[list[int]], max_tokens: int) -> list[int]:
        gen_config = GenerationConfig(
            max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=pad_id
        )
        results = model.generate_batch(
            inputs=prompt_ids, generation_config=gen_config, continuous_batching_config=cb_config,
        )
        assert len(results) == len(prompt_ids), f"{len(results)} results for {len(prompt_ids)} prompts"
        return [len(r.generated_tokens) for r in results.values()]

    generate(WARMUP_PROMPTS, WARMUP_TOKENS)
    return {"load_s": load_s, **timed(lambda: generate(job.prompt_ids, job.max_tokens))}


def run_roofline(job: Job) -> dict:
    """Bandwidth, and the GEMM of only the dtypes the parent chose (those this CPU runs)."""
    from roofline import measure_bandwidth

    watch = CpuWatch()
    bandwidth = measure_bandwidth()
    gemm = {name: _gemm_or_failure(name) for name in job.gemm_dtypes}
    return {**bandwidth, "gemm": gemm, "tok_s": 0.0, **watch.read()}


def _gemm_or_failure(dtype_name: str) -> dict:
    """One dtype's GEMM figure, or why it failed: one dtype must not cost the bandwidth."""
    import torch

    from roofline import measure_gemm

    try:
        return measure_gemm(getattr(torch, dtype_name))
    except RuntimeError as error:
        return {"failed": _last_line(str(error)) or type(error).__name__}


CHILD_RUNNERS = {
    "cadence": run_cadence,
    "hf-static": run_hf_static,
    "hf-cb": run_hf_cb,
    "roofline": run_roofline,
}


# ==================================================================== parent


def workload_prompt_ids(model_path: str, num_prompts: int) -> list[list[int]]:
    """Each user message through the model's chat template, checked against the file's ids."""
    from cadence.models.gguf_loader import read_gguf
    from cadence.models.tokenizer import Tokenizer

    workload = json.loads(WORKLOAD_FILE.read_text())
    assert workload["workload"] == WORKLOAD, workload["workload"]
    tokenizer = Tokenizer.from_gguf_metadata(read_gguf(model_path)[1])
    prompt_ids = []
    for message in workload["user_messages"][:num_prompts]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True)
        prompt_ids.append(tokenizer.encode(text, add_special_tokens=False))
    expected = workload["prompt_ids"][:num_prompts]
    assert prompt_ids == expected, "chat-templated prompt ids differ from the workload file's"
    return prompt_ids


def run_job(job: Job, verbose: bool, timeout_s: float) -> dict:
    """One system in a fresh interpreter; its RESULT line parsed, or ``RunFailed``
    with the last line of its stderr (a traceback ends with the error)."""
    command = [sys.executable, __file__, "--child", job.system, "--dtype", job.dtype]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        proc = subprocess.run(command, input=json.dumps(job.__dict__), capture_output=True,
                              text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RunFailed(f"timed out after {timeout_s:.0f} s (--timeout)") from None
    if verbose or proc.returncode:
        sys.stderr.write(proc.stderr)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if proc.returncode or not lines:
        raise RunFailed(_last_line(proc.stderr) or f"exit {proc.returncode}, no result")
    return json.loads(lines[-1][len(RESULT_MARK):])


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def measure(job: Job, args: argparse.Namespace, label: str) -> dict:
    """Runs of one system, each in a fresh process, and the one reported.

    The machine is shared: each run starts after a quiet moment, and a run
    during which other processes kept more than ``args.max_others`` cores
    busy (two threads on two cores stall at every OpenMP barrier then) is
    run again, up to ``args.max_attempts`` runs in all. Reported: the fastest
    undisturbed run, else the fastest run. A failed run ends the attempts (a
    failure repeats; a timed-out one would cost its timeout again); with no
    run done, the result is ``{"failed": why}``.
    """
    runs: list[dict] = []
    while len(runs) < args.max_attempts and len(_undisturbed(runs, args)) < args.repeats:
        others = wait_for_quiet(args.wait_quiet)
        print(f"running {label} (others busy {others:.2f} cores) ...", file=sys.stderr, flush=True)
        try:
            result = run_job(job, args.verbose, args.timeout)
            if job.system != "roofline":
                check_tokens(label, result, job)
        except RunFailed as error:
            print(f"  {label} failed: {error}", file=sys.stderr, flush=True)
            if not runs:
                return {"failed": str(error)}
            break
        if job.system != "roofline":
            print(f"  {result['tok_s']:,.0f} tok/s, {result['wall_s']:.1f} s, peak RSS "
                  f"{result['peak_rss_mib']:,.0f} MiB, others {result['others_cores']:.2f} cores",
                  file=sys.stderr, flush=True)
        runs.append(result)
    candidates = _undisturbed(runs, args) or runs
    if job.system == "roofline":
        return _best_machine(candidates)
    best = max(candidates, key=lambda r: r["tok_s"])
    return {**best, "runs": [(r["tok_s"], r["others_cores"]) for r in runs]}


def _undisturbed(runs: list[dict], args: argparse.Namespace) -> list[dict]:
    return [r for r in runs if r["others_cores"] <= args.max_others]


def _best_machine(runs: list[dict]) -> dict:
    """Each roofline figure at its best over the runs."""
    best = dict(runs[0])
    for key in ("copy_gbs", "read_gbs", "bandwidth_gbs"):
        best[key] = max(r[key] for r in runs)
    best["gemm"] = {d: max((r["gemm"][d] for r in runs), key=lambda g: g.get("gflops", -1.0))
                    for d in runs[0]["gemm"]}
    best["others_cores"] = min(r["others_cores"] for r in runs)
    return best


def wait_for_quiet(max_wait_s: float, threshold: float = QUIET_CORES) -> float:
    """Wait (at most ``max_wait_s``) until other processes use under ``threshold`` cores."""
    deadline = time.monotonic() + max_wait_s
    while True:
        busy0 = _busy_cpu_seconds()
        time.sleep(QUIET_WINDOW_S)
        others = (_busy_cpu_seconds() - busy0) / QUIET_WINDOW_S
        if others < threshold or time.monotonic() >= deadline:
            return others


def run_measured_child(argv: list[str], job: dict, *, cwd: Path, max_attempts: int, max_others: float,
                       wait_quiet_s: float, timeout_s: float = 3600) -> dict:
    """One measured child process (``argv``, ``job`` as JSON on its stdin, its result
    the last ``RESULT`` line of its stdout), run again (up to ``max_attempts``) while
    other processes kept more than ``max_others`` cores busy; the result says how many."""
    result: dict = {}
    for _ in range(max_attempts):
        wait_for_quiet(wait_quiet_s, max_others)
        watch, children = CpuWatch(), _children_cpu_seconds()
        done = subprocess.run(argv, input=json.dumps(job), capture_output=True, text=True, cwd=cwd,
                              timeout=timeout_s)
        reading = watch.read()  # its "others" count the child: take the child's CPU out
        others = max(0.0, reading["others_cores"] - (_children_cpu_seconds() - children) / reading["wall_s"])
        lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARK)]
        if done.returncode or not lines:
            raise RuntimeError(f"{' '.join(argv[1:])} failed:\n{done.stderr[-3000:]}")
        result = json.loads(lines[-1][len(RESULT_MARK):]) | {"others busy cores": round(others, 2)}
        if others <= max_others:
            break
    return result


def _children_cpu_seconds() -> float:
    times = os.times()
    return times.children_user + times.children_system


def check_tokens(label: str, result: dict, job: Job) -> None:
    """Every prompt got exactly max_tokens new tokens (else the run is a failed row)."""
    expected = [job.max_tokens] * len(job.prompt_ids)
    if result["token_counts"] != expected:
        raise RunFailed(f"{label}: token counts {result['token_counts']}, expected {job.max_tokens} each")


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        load = os.getloadavg()
        return f"load average: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}"


@dataclass(frozen=True)
class DtypePlan:
    """The dtypes this run measures, which of them the CPU only emulates, and what it left out."""

    run: list[str]
    emulated: dict[str, str] = field(default_factory=dict)  # dtype -> why (marked in the tables)
    skipped: dict[str, str] = field(default_factory=dict)  # dtype -> why it was not run


def plan_dtypes(requested: list[str] | None, include_emulated: bool, features=None) -> DtypePlan:
    """The dtypes asked for (default: all), less those this CPU computes in software
    unless ``include_emulated``: an emulated bfloat16 table takes tens of minutes and
    measures the emulation, not the engine."""
    import torch

    from cadence import cpu_features
    from cadence.runner.cpu_paths import emulation_note

    features = cpu_features.detect() if features is None else features
    plan = DtypePlan([])
    for name in requested or DTYPES:
        note = emulation_note(getattr(torch, name), features)
        if note is None or include_emulated:
            plan.run.append(name)
            if note is not None:
                plan.emulated[name] = note
        else:
            plan.skipped[name] = f"{note}; --include-emulated measures it anyway"
    return plan


def roofline_rows(machine: dict, model_path: str, prompt_ids: list[list[int]], max_tokens: int) -> dict:
    """Per dtype whose GEMM was measured: the workload's compute-bound, memory-bound
    and overall bound."""
    import torch

    from cadence.models.gguf_loader import gguf_model_config, read_gguf
    from roofline import workload_cost

    config = gguf_model_config(*read_gguf(model_path))
    rows = {}
    for dtype, gemm in machine["gemm"].items():
        if "gflops" not in gemm:
            continue  # failed: the machine line says why
        cost = workload_cost(config, [len(p) for p in prompt_ids], max_tokens, getattr(torch, dtype))
        rows[dtype] = {
            **cost.bound(gemm["gflops"], machine["bandwidth_gbs"]),
            "gflops": gemm["gflops"],
            "tflop_total": cost.flops / 1e12,
            "gb_total": cost.bytes / 1e9,
            "weight_mb_per_step": cost.weight_bytes_per_step / 1e6,
            "kv_gb_read": cost.kv_bytes_read / 1e9,
        }
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: {QUICK_PROMPTS} prompts x {QUICK_TOKENS} tokens")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated subset of {','.join(SYSTEMS)}")
    parser.add_argument("--dtypes", default=None,
                        help=f"comma-separated subset of {','.join(DTYPES)} (default: those this CPU "
                             f"computes natively: float32, and bfloat16 where it has AVX512_BF16, AMX "
                             f"or ARM BF16)")
    parser.add_argument("--include-emulated", action="store_true",
                        help="also measure dtypes this CPU only emulates (bfloat16 on AVX2-only x86): "
                             "slow, marked emulated, the GEMM on a small matrix")
    parser.add_argument("--timeout", type=float, default=CHILD_TIMEOUT_S, metavar="SECONDS",
                        help="a child running longer is stopped and its row says so")
    parser.add_argument("--repeats", type=int, default=1,
                        help="undisturbed runs wanted per system (each in a fresh process); "
                             "the fastest is reported")
    parser.add_argument("--max-others", type=float, default=QUIET_CORES, metavar="CORES",
                        help="a run during which other processes used more cores than this is disturbed")
    parser.add_argument("--max-attempts", type=int, default=3,
                        help="most runs per system while looking for undisturbed ones")
    parser.add_argument("--wait-quiet", type=float, default=60.0, metavar="SECONDS",
                        help=f"before each run, wait up to SECONDS for other processes to use "
                             f"under {QUIET_CORES} cores")
    parser.add_argument("--model", default=None, help="GGUF path (default: the embedded SmolLM2)")
    parser.add_argument("--json", metavar="PATH", help="also write every figure to this JSON file")
    parser.add_argument("--verbose", action="store_true", help="show the children's stderr")
    parser.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", choices=DTYPES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.systems = _subset(parser, "systems", args.systems, SYSTEMS)
    args.dtypes = None if args.dtypes is None else _subset(parser, "dtypes", args.dtypes, DTYPES)
    return args


def _subset(parser, name: str, text: str, allowed: tuple[str, ...]) -> list[str]:
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in allowed]
    if unknown:
        parser.error(f"--{name}: unknown {unknown}; choose from {','.join(allowed)}")
    return [s for s in allowed if s in chosen]  # table order


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        run_child(args.child, args.dtype)
        return
    from cadence.models.loader import default_model_path
    from throughput_report import dtype_label, print_report

    model_path = args.model or default_model_path()
    num_prompts, max_tokens = (QUICK_PROMPTS, QUICK_TOKENS) if args.quick else (64, MAX_TOKENS)
    prompt_ids = workload_prompt_ids(model_path, num_prompts)
    plan = plan_dtypes(args.dtypes, args.include_emulated)
    header = make_header(num_prompts, max_tokens)
    results, machine = {}, None
    if "roofline" in args.systems:
        job = Job("roofline", "float32", [], 0, model_path, gemm_dtypes=plan.run)
        machine = measure(job, args, "roofline")
    for dtype in plan.run:
        for system in args.systems:
            if system != "roofline":
                job = Job(system, dtype, prompt_ids, max_tokens, model_path)
                results[(system, dtype)] = measure(job, args, f"{system} {dtype_label(dtype, plan)}")
    header["uptime_end"] = uptime()
    roofline = None
    if machine and "failed" not in machine:
        roofline = roofline_rows(machine, model_path, prompt_ids, max_tokens)
    print_report(results, roofline, machine, header, plan)
    if args.json:
        payload = {
            "header": header, "plan": plan.__dict__, "machine": machine, "roofline": roofline,
            "results": [{"system": s, "dtype": d, **r} for (s, d), r in results.items()],
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))


def make_header(num_prompts: int, max_tokens: int) -> dict:
    """What the report names: the workload, the CPU as cadence sees it (model, the
    flags that pick paths, any hidden), and the library versions."""
    import torch

    from cadence import cpu_features

    return {
        "workload": WORKLOAD, "version": WORKLOAD.rsplit("-", 1)[1].lstrip("v"),
        "num_prompts": num_prompts, "max_tokens": max_tokens, "num_threads": NUM_THREADS,
        "cpu": f"{cpu_features.detect().describe()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__, "transformers": _version("transformers"), "uptime_start": uptime(),
    }


def _version(package: str) -> str:
    """The installed version, or "not installed" (only the hf rows need transformers)."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    main()
