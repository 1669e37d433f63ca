#!/usr/bin/env python3
"""cadence on one GPU: a Llama-3-8B-shaped model, against transformers and the simulator.

The model has Llama-3-8B's shape (32 layers, hidden 4096, GQA 32:8, vocab
128256) with random bfloat16 weights made on the GPU: speed does not depend
on the values, and no checkpoint has to travel. EOS is ignored, so every
request generates exactly its output length.

Parts (``--part``, default all):

- ``cadence``:
  1. offline throughput: 1,000 requests all at t=0, prompts uniform
     256..768 tokens (mean 512), 128 output tokens each; output tokens/s,
     TTFT and TPOT, and the roofline simulation of the same requests
     (``roofline:h100``: 989 TFLOP/s, 3.35 TB/s);
  2. decode step time at batch 1, 64 and 256 (contexts ~512), against the
     weights-read bound (weight bytes / 3.35 TB/s);
  3. the simulator against the real run: a Poisson trace (output lengths
     uniform 64..192) replayed in real time, then a cost model calibrated
     on this GPU (``cadence.sim.calibrate`` with a GPU-sized grid), and the
     same trace simulated with it and with ``roofline:h100``.
- ``hf``: transformers' continuous batching (``generate_batch``) on the
  same 1,000 prompts and the same GPU.

    python bench/gpu_serving.py --out results/ [--part cadence|hf|all] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from cadence.config import CacheConfig, EngineConfig, EngineOptions, SchedulerConfig  # noqa: E402
from cadence.core.request import Request  # noqa: E402
from cadence.engine.builder import assemble_engine  # noqa: E402
from cadence.models.config import ModelConfig  # noqa: E402
from cadence.models.llama import LlamaForCausalLM  # noqa: E402
from cadence.sampling_params import SamplingParams  # noqa: E402
from cadence.sim.calibrate import Scenario, describe_fit, fit_engine_model, measure  # noqa: E402
from cadence.sim.cost_model import LLAMA_3_8B, PROFILES, make_cost_model  # noqa: E402
from cadence.sim.metrics import MetricsRecorder, summarize  # noqa: E402
from cadence.sim.simulator import RequestFactory, Simulator, WallClock, drive  # noqa: E402
from cadence.sim.workload import PromptMaker, RequestSpec, SyntheticWorkload  # noqa: E402

MAX_NUM_SEQS = 256
MAX_BATCHED_TOKENS = 8192
MAX_MODEL_LEN = 2048
PROMPT_SEED = 7
H100 = PROFILES["h100"]


def offline_specs(num_requests: int) -> list[RequestSpec]:
    return SyntheticWorkload(num_requests=num_requests, rate=0.0, prompt_len="uniform:256:768",
                             output_len="fixed:128", seed=0).generate()


def trace_specs(num_requests: int, rate: float) -> list[RequestSpec]:
    return SyntheticWorkload(num_requests=num_requests, rate=rate, prompt_len="uniform:256:768",
                             output_len="uniform:64:192", seed=1).generate()


def gpu_scenarios(quick: bool) -> list[Scenario]:
    """The calibration grid, GPU-sized: long prefill chunks, decode batches to 256."""
    chunks = (512, 2048, 8192) if quick else (256, 512, 1024, 2048, 4096, 8192)
    batches = (1, 16, 64, 256) if quick else (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
    # Prompts of ~2,000 tokens (max_model_len 2048): chunks past that span several.
    scenarios = [Scenario(chunk, max(1, chunk // 2048), 2040, 2) for chunk in chunks]
    scenarios += [Scenario(8192, b, ctx, 6, num_unique_tokens=16, min_prompt_len=ctx - 64)
                  for b in batches for ctx in (320, 960)]
    # Serving mixes: one or a few prefills joining a running decode batch each step.
    scenarios += [Scenario(1024, 16, 768, 48, min_prompt_len=256, arrivals_per_step=1),
                  Scenario(1024, 32, 640, 64, min_prompt_len=384, arrivals_per_step=1),
                  Scenario(2048, 64, 768, 48, min_prompt_len=256, arrivals_per_step=4),
                  Scenario(8192, 128, 768, 64, min_prompt_len=256, arrivals_per_step=16)]
    return scenarios


def llama3_8b_config() -> ModelConfig:
    return ModelConfig.from_hf_config({**LLAMA_3_8B, "architectures": ["LlamaForCausalLM"]})


def random_model(config: ModelConfig, dtype: torch.dtype = torch.bfloat16,
                 device: str = "cuda") -> LlamaForCausalLM:
    """The model built on the device, weights N(0, 0.02), norms 1."""
    with torch.device(device):
        model = LlamaForCausalLM(config, dtype)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return model.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def build(args, log) -> tuple:
    if args.smoke:  # the script's own check, on the CPU: a tiny model
        from cadence.models.testing import tiny_config

        config, device, dtype = tiny_config(vocab_size=512, max_position_embeddings=4096), "cpu", "float32"
    else:
        config, device, dtype = llama3_8b_config(), "cuda", "bfloat16"
    start = time.perf_counter()
    model = random_model(config, getattr(torch, dtype), device)
    options = EngineOptions(
        engine=EngineConfig(device=device, dtype=dtype),
        scheduler=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_BATCHED_TOKENS,
                                  max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(),
    )
    engine = assemble_engine(options, model, config, None, log=sys.stderr)
    log(f"built in {time.perf_counter() - start:.1f} s: {weight_bytes(model) / 1e9:.2f} GB of weights, "
        f"{engine.options.cache.num_gpu_blocks} KV blocks")
    return engine, model


def real_run(engine, specs: list[RequestSpec]) -> dict:
    """The specs through the engine in real time (the simulator's own loop and metrics)."""
    from cadence.core.sched.scheduler import Scheduler
    from cadence.engine.core import EngineCore

    scheduler = Scheduler(engine.options.scheduler, engine.options.cache)
    core = EngineCore(scheduler, engine.core.runner)
    factory = RequestFactory(PromptMaker(engine.model_config.vocab_size, seed=PROMPT_SEED),
                             engine.options.scheduler.max_model_len)
    recorder = MetricsRecorder(specs)
    start = time.perf_counter()
    num_steps = drive(core, specs, factory, WallClock(), recorder)
    summary = summarize(recorder, num_preemptions=scheduler.num_preemptions_total)
    summary.update(num_steps=num_steps, wall_s=time.perf_counter() - start)
    return summary


def simulated_run(engine, specs: list[RequestSpec], cost_model) -> dict:
    simulator = Simulator(engine.options.scheduler, engine.options.cache, cost_model,
                          prompt_maker=PromptMaker(engine.model_config.vocab_size, seed=PROMPT_SEED))
    result = simulator.run(specs, label=cost_model.name if hasattr(cost_model, "name") else "sim")
    summary = result.summary()
    summary["num_steps"] = result.num_steps
    return summary


def headline(summary: dict) -> dict:
    return {
        "output_tokens_per_s": summary["throughput"]["output_tokens_per_s"],
        "ttft_p50_s": summary["ttft_s"]["p50"], "ttft_p90_s": summary["ttft_s"]["p90"],
        "tpot_p50_s": summary["tpot_s"]["p50"], "tpot_p90_s": summary["tpot_s"]["p90"],
        "num_steps": summary.get("num_steps"),
    }


def decode_step_times(engine, batch_sizes: list[int], context: int, num_steps: int) -> dict:
    """Median engine step time of decode-only steps at each batch size."""
    from cadence.core.sched.scheduler import Scheduler
    from cadence.engine.core import EngineCore

    runner = engine.core.runner
    prompts = PromptMaker(engine.model_config.vocab_size, seed=99)
    results = {}
    for batch in batch_sizes:
        config = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=MAX_BATCHED_TOKENS,
                                 max_model_len=MAX_MODEL_LEN)
        core = EngineCore(Scheduler(config, engine.options.cache), runner)
        params = SamplingParams(max_tokens=num_steps + 8, ignore_eos=True, temperature=0.0)
        for i in range(batch):
            spec = RequestSpec(0.0, context, num_steps + 8)
            core.add_request(Request(f"d{batch}-{i}", prompts.make(i, spec), params,
                                     max_model_len=MAX_MODEL_LEN))
        while core.scheduler.get_request_counts()[1] or _prefilling(core):
            core.step()
        core.step()  # first all-decode step
        times = []
        for _ in range(num_steps):
            start = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - start)
        results[batch] = {"median_s": statistics.median(times), "min_s": min(times),
                          "forward_s": _graph_forward_seconds(runner, batch)}
        while core.has_work():
            core.step()
    return results


def _graph_forward_seconds(runner, batch: int) -> float | None:
    """GPU time of the model forward alone: the decode graph replayed on the last step's inputs.

    A replay recomputes the last step's tokens and writes the same keys and
    values again, so the requests in flight are unharmed.
    """
    graphs = runner.decode_graphs
    if graphs is None or batch > graphs.max_size:
        return None
    size = next(s for s in graphs.capture_sizes if s >= batch)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graphs.graphs[size].replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20 / 1000


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def _prefilling(core) -> bool:
    return any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running)


def run_cadence(args, log) -> dict:
    engine, model = build(args, log)
    weights = weight_bytes(model)
    result: dict = {"weights_bytes": weights, "kv_blocks": engine.options.cache.num_gpu_blocks,
                    "host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
                            f"{_cpu_model()}",
                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    # Warm-up: a few requests through every path (prefill shapes, graphs).
    real_run(engine, offline_specs(8))

    specs = offline_specs(args.num_requests)
    log(f"offline: {len(specs)} requests ...")
    result["offline"] = headline(real_run(engine, specs))
    log(f"  {result['offline']}")
    roofline = make_cost_model("roofline:h100", "llama-3-8b")
    result["offline_roofline_sim"] = headline(simulated_run(engine, specs, roofline))

    log("decode step times ...")
    steps = decode_step_times(engine, [1, 64, 256], context=512, num_steps=10 if args.quick else 30)
    bound = weights / H100.mem_bandwidth
    result["decode"] = {str(b): {**t, "weights_read_bound_s": bound, "over_bound": t["median_s"] / bound}
                        for b, t in steps.items()}
    log(f"  {result['decode']}")

    if args.skip_sim:
        return result
    trace = trace_specs(args.trace_requests, args.trace_rate)
    log(f"trace: {len(trace)} requests at {args.trace_rate}/s ...")
    real = headline(real_run(engine, trace))
    log("calibrating ...")
    scenarios = gpu_scenarios(args.quick)
    shapes, seconds = measure(engine, scenarios, log=log)
    calibrated = fit_engine_model(engine, shapes, seconds, scenarios, log=log)
    if args.out:
        calibrated.save(str(Path(args.out) / "h100_calibrated.json"))
    sims = {"calibrated": headline(simulated_run(engine, trace, calibrated)),
            "roofline:h100": headline(simulated_run(engine, trace, roofline))}
    result["sim_vs_real"] = {
        "trace": {"num_requests": len(trace), "rate": args.trace_rate,
                  "prompt_len": "uniform:256:768", "output_len": "uniform:64:192"},
        "calibration": describe_fit(calibrated),
        "real": real,
        **{name: {**sim, "over_real": {k: sim[k] / real[k] for k in
                                       ("output_tokens_per_s", "ttft_p50_s", "tpot_p50_s") if real[k]}}
           for name, sim in sims.items()},
    }
    return result


def run_hf(args, log) -> dict:
    import transformers
    from transformers import GenerationConfig

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(**{k: v for k, v in LLAMA_3_8B.items() if k != "model_type"})
    start = time.perf_counter()
    with torch.device("cuda"):
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    hf.eval()
    log(f"transformers model built in {time.perf_counter() - start:.1f} s")
    specs = offline_specs(args.num_requests)
    prompts = PromptMaker(config.vocab_size, seed=PROMPT_SEED)
    prompt_ids = [prompts.make(i, spec) for i, spec in enumerate(specs)]
    gen = GenerationConfig(max_new_tokens=128, do_sample=False, eos_token_id=None, pad_token_id=0)
    hf.generate_batch(inputs=prompt_ids[:8], generation_config=gen)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    results = hf.generate_batch(inputs=prompt_ids, generation_config=gen)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    num_out = sum(len(r.generated_tokens) for r in results.values())
    return {"transformers": transformers.__version__, "num_requests": len(results),
            "output_tokens": num_out, "wall_s": elapsed, "output_tokens_per_s": num_out / elapsed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", default="all", choices=("all", "cadence", "hf"))
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--trace-requests", type=int, default=400)
    parser.add_argument("--trace-rate", type=float, default=8.0)
    parser.add_argument("--quick", action="store_true", help="smaller calibration grid and step samples")
    parser.add_argument("--skip-sim", action="store_true", help="cadence part without the simulator section")
    parser.add_argument("--smoke", action="store_true", help="check the script on the CPU with a tiny model")
    parser.add_argument("--out", help="folder for results.json and the calibrated cost model")
    args = parser.parse_args()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    results: dict = {"args": vars(args)}
    if args.part in ("all", "cadence"):
        results["cadence"] = run_cadence(args, log)
    if args.part in ("all", "hf"):
        try:
            results["hf_cb"] = run_hf(args, log)
        except Exception as error:  # report, keep the cadence figures
            results["hf_cb"] = {"error": f"{type(error).__name__}: {error}"}
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        (Path(args.out) / f"results_{args.part}.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
