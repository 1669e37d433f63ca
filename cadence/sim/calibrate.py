"""Fit a ``CalibratedCostModel`` to the real CPU runner on the default model.

Each scenario starts a fresh scheduler (its own token budget) on the one real
runner, adds ``num_seqs`` requests with random ``prompt_len``-token prompts
and lets them generate ``max_tokens`` tokens. Every step is timed whole
(schedule + execute + update: the simulator charges a step's whole time to
its runner) and its shape read from the ``SchedulerOutput``:

    budget  32, 1 x 1024-token prompt   -> 32 prefill chunks of 32 at contexts 0..992
    budget 2048, 16 x 128-token prompts -> 1 prefill step (120 shared tokens computed once,
    sharing all but 8 tokens                  then 8 x 15), then decodes of 16 at contexts 129, ...

The fit is least squares on relative error (``CalibratedCostModel.fit``):
by default ``t = curve(tokens) + c*seqs + d*kv_tokens`` with the curve
piecewise linear over token-count knots (on this CPU a decode batch of 3
costs more than one of 4: matrix-multiply speed depends on the row count),
or the plain line ``a + b*tokens + c*seqs + d*kv_tokens``. It is refitted
once without the worst tenth of the steps: on a shared machine a few steps
are stretched by other processes and would drag the fit.

Imports the engine (torch) when called: ``cadence.sim`` itself does not.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from cadence.config import CacheConfig, SchedulerConfig
from cadence.core.runner_api import RunnerBase
from cadence.core.outputs import ModelRunnerOutput
from cadence.core.request import Request
from cadence.core.sched.output import SchedulerOutput
from cadence.core.sched.scheduler import Scheduler
from cadence.engine.core import EngineCore
from cadence.sampling_params import SamplingParams
from cadence.sim.cost_model import DEFAULT_TOKEN_KNOTS, CalibratedCostModel, StepShape, step_shape

# With the token curve (the default), the linear terms besides it.
CURVE_FEATURES = ("seqs", "kv_tokens")
from cadence.sim.workload import PromptMaker, RequestSpec


@dataclass(frozen=True)
class Scenario:
    """One batch shape (or a small serving mix) to time.

    - ``min_prompt_len``: prompt lengths spread evenly from it to
      ``prompt_len`` (in a shuffled order), so contexts in a batch differ as
      they do when serving;
    - ``num_unique_tokens``: the prompts share all but their last
      ``num_unique_tokens`` tokens (of the shortest prompt): the prefix cache
      computes the shared part once, so a wide batch at a long context is
      cheap to set up;
    - ``arrivals_per_step``: requests join a few per step instead of all at
      once, so prefill chunks run beside decodes.
    """

    max_num_batched_tokens: int
    num_seqs: int
    prompt_len: int
    max_tokens: int
    num_unique_tokens: int | None = None
    min_prompt_len: int | None = None
    arrivals_per_step: int = 0  # 0: all before the first step

    @property
    def label(self) -> str:
        lengths = f"{self.min_prompt_len}..{self.prompt_len}" if self.min_prompt_len else str(self.prompt_len)
        joined = f" +{self.arrivals_per_step}/step" if self.arrivals_per_step else ""
        return f"budget={self.max_num_batched_tokens} seqs={self.num_seqs} prompt={lengths}{joined}"

    def request_specs(self) -> list[RequestSpec]:
        n, longest = self.num_seqs, self.prompt_len
        shortest = self.min_prompt_len or longest
        lengths = [shortest + (longest - shortest) * i // max(n - 1, 1) for i in range(n)]
        lengths = [lengths[(i * 7) % n] for i in range(n)] if n % 7 else lengths
        if self.num_unique_tokens is None:
            return [RequestSpec(0.0, length, 1) for length in lengths]
        shared = max(shortest - self.num_unique_tokens, 0)
        return [RequestSpec(0.0, length, 1, prefix_group=0, prefix_tokens=shared) for length in lengths]


def default_scenarios(quick: bool = False) -> list[Scenario]:
    """Prefill chunks of 16..512; decode batches of 1..32 at short and long contexts; two serving mixes.

    Decode batches come in many sizes (not only powers of two): the token
    curve needs a point at each knot, and odd sizes run slower kernels.
    """
    chunks = (32, 128) if quick else (16, 64, 256, 512)
    batches = (1, 2, 3, 4, 6, 8, 16) if quick else (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)
    contexts = (48, 320)
    num_mixed = 12 if quick else 24
    scenarios = [Scenario(chunk, 1, 512, 2) for chunk in chunks]
    scenarios += [Scenario(2048, b, ctx, 5 if quick else 7, num_unique_tokens=8, min_prompt_len=ctx - 16)
                  for b in batches for ctx in contexts]
    scenarios += [
        Scenario(512, num_mixed, 160, 32, min_prompt_len=16, arrivals_per_step=1),
        Scenario(256, num_mixed, 96, 24, min_prompt_len=16, arrivals_per_step=2),
    ]
    return scenarios


_EMPTY = StepShape(0, 0, 0, 0)


class _ShapeRecorder(RunnerBase):
    """Wraps the real runner: remembers the shape of the step it runs."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.last_shape = StepShape(0, 0, 0, 0)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.last_shape = step_shape(scheduler_output)
        return self.runner.execute_model(scheduler_output)


def time_scenarios(
    runner: Any,
    cache_config: CacheConfig,
    max_model_len: int,
    scenarios: Sequence[Scenario],
    *,
    vocab_size: int,
    eos_token_id: int | None = None,
    timer: Callable[[], float] = time.perf_counter,
    log: Callable[[str], None] = lambda _: None,
) -> tuple[list[StepShape], list[float]]:
    """Shapes and seconds (wall, or whatever ``timer`` reads) of every step that computed something."""
    recorder = _ShapeRecorder(runner)
    shapes: list[StepShape] = []
    seconds: list[float] = []
    for n, scenario in enumerate(scenarios):
        prompts = PromptMaker(vocab_size, seed=12345 + n)  # no prefix shared across scenarios
        config = SchedulerConfig(
            max_num_seqs=max(scenario.num_seqs, 1),
            max_num_batched_tokens=scenario.max_num_batched_tokens,
            max_model_len=max_model_len,
        )
        core = EngineCore(Scheduler(config, cache_config), recorder)
        params = SamplingParams(max_tokens=scenario.max_tokens, ignore_eos=True, temperature=0.0)
        requests = [
            Request(f"cal{n}-{i}", prompts.make(i, spec), params, eos_token_id=eos_token_id,
                    max_model_len=max_model_len)
            for i, spec in enumerate(scenario.request_specs())
        ]
        per_step = scenario.arrivals_per_step or len(requests)
        num_before = len(seconds)
        while requests or core.has_work():
            for request in requests[:per_step]:
                core.add_request(request)
            del requests[:per_step]
            start = timer()
            core.step()
            elapsed = timer() - start
            if recorder.last_shape.num_tokens:
                shapes.append(recorder.last_shape)
                seconds.append(elapsed)
            recorder.last_shape = _EMPTY
        steps = seconds[num_before:]
        log(f"  {scenario.label}: {len(steps)} steps, {1000 * sum(steps) / max(len(steps), 1):.1f} ms/step")
    return shapes, seconds


def fit_trimmed(
    shapes: Sequence[StepShape], seconds: Sequence[float], features: Sequence[str],
    token_knots: Sequence[int] | None = None, trim: float = 0.1,
) -> CalibratedCostModel:
    """Fit, drop the ``trim`` share of steps the fit explains worst, fit again."""
    model = CalibratedCostModel.fit(shapes, seconds, features, token_knots=token_knots)
    errors = [abs(model.step_seconds(s) - t) / t for s, t in zip(shapes, seconds)]
    cutoff = sorted(errors)[int(len(errors) * (1 - trim))] if trim else float("inf")
    kept = [i for i, e in enumerate(errors) if e < cutoff] or list(range(len(errors)))
    refit = CalibratedCostModel.fit([shapes[i] for i in kept], [seconds[i] for i in kept], features,
                                    token_knots=token_knots)
    refit.meta["num_steps_dropped"] = len(shapes) - len(kept)
    return refit


def calibrate(
    engine: Any = None,
    *,
    dtype: str = "auto",
    num_threads: int | None = None,
    scenarios: Sequence[Scenario] | None = None,
    features: Sequence[str] = CURVE_FEATURES,
    token_knots: Sequence[int] | None = DEFAULT_TOKEN_KNOTS,
    log: Callable[[str], None] = print,
) -> CalibratedCostModel:
    """Time the real CPU runner (the default model unless ``engine`` is given) and fit."""
    if engine is None:
        engine = build_default_engine(dtype=dtype, num_threads=num_threads)
    scenarios = list(scenarios or default_scenarios())
    shapes, seconds = measure(engine, scenarios, log=log)
    return fit_engine_model(engine, shapes, seconds, scenarios, features, token_knots, log=log)


def measure(
    engine: Any, scenarios: Sequence[Scenario], *, warmup: bool = True,
    timer: Callable[[], float] = time.perf_counter, log: Callable[[str], None] = lambda _: None,
) -> tuple[list[StepShape], list[float]]:
    """Timed steps of ``scenarios`` on the engine's runner."""
    cache_config = engine.options.cache
    vocab_size = engine.model_config.vocab_size
    if warmup:  # first steps pay for allocation and kernel selection
        time_scenarios(engine.core.runner, cache_config, engine.max_model_len,
                       [Scenario(256, 4, 64, 4)], vocab_size=vocab_size)
    log(f"timing {len(scenarios)} scenarios")
    return time_scenarios(engine.core.runner, cache_config, engine.max_model_len, scenarios,
                          vocab_size=vocab_size, timer=timer, log=log)


def fit_engine_model(
    engine: Any, shapes: Sequence[StepShape], seconds: Sequence[float], scenarios: Sequence[Scenario],
    features: Sequence[str] = CURVE_FEATURES, token_knots: Sequence[int] | None = DEFAULT_TOKEN_KNOTS,
    *, log: Callable[[str], None] = lambda _: None,
) -> CalibratedCostModel:
    """The fit, with the engine's KV-cache size and where the timings came from."""
    model = fit_trimmed(shapes, seconds, features, token_knots)
    model.kv_blocks = engine.options.cache.num_gpu_blocks
    model.meta.update(_provenance(engine, scenarios, features))
    log(f"fit: {describe_fit(model)}")
    return model


def describe_fit(model: CalibratedCostModel) -> str:
    """One line: the formula with its fitted numbers."""
    if model.token_curve is None:
        base = f"{model.intercept * 1e3:.2f} ms"
    else:
        curve = model.token_curve
        points = ", ".join(f"{k}:{v * 1e3:.0f}" for k, v in zip(curve.knots, curve.seconds))
        base = f"curve(tokens) [ms at {points}]"
    terms = " ".join(f"+ {c * 1e6:.2f} us*{f}" for f, c in model.coefficients.items())
    return f"t = {base} {terms} (mean |rel err| {model.meta['mean_abs_rel_error']:.1%})"


def build_default_engine(*, dtype: str = "auto", num_threads: int | None = None, **options: Any):
    """The real engine on the default model (imports torch)."""
    from cadence.config import EngineOptions
    from cadence.engine.builder import build_engine

    return build_engine(EngineOptions.from_kwargs(dtype=dtype, num_threads=num_threads, **options))


def _provenance(engine: Any, scenarios: Sequence[Scenario], features: Sequence[str]) -> dict[str, Any]:
    import torch

    return {
        "model": engine.options.engine.model or "default (SmolLM2-135M-Instruct Q4_1 GGUF)",
        "dtype": engine.options.engine.dtype,
        "num_threads": torch.get_num_threads(),
        "block_size": engine.options.cache.block_size,
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus".strip(),
        "python": platform.python_version(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "features": list(features),
        "scenarios": [dataclasses.asdict(s) for s in scenarios],
    }
