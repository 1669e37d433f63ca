"""What one engine step costs: a roofline from the hardware, or a fit to real timings.

A cost model sees only the shape of a step (``StepShape``), measured from the
``SchedulerOutput`` the real scheduler produced:

    sequence s: c_s tokens already in the KV cache, q_s new tokens this step

    num_tokens     = sum q_s                      (prefill chunks + decodes)
    num_seqs       = number of scheduled sequences
    num_kv_tokens  = sum (c_s + q_s)              (KV each sequence's attention reads)
    num_attn_pairs = sum q_s*c_s + q_s(q_s+1)/2   (causal query-key pairs)

Two models:

- ``RooflineCostModel``: hardware peaks and efficiencies, and the model's
  shape from a Hugging Face ``config.json`` dict.
      compute = 2 * params * num_tokens + 4 * layers * heads * head_dim * num_attn_pairs
      memory  = params * dtype_bytes + num_kv_tokens * kv_bytes_per_token
      step    = max(compute / (peak * eff_c), memory / (bandwidth * eff_m)) + overhead
  The cache's width follows ``--kv-cache-dtype`` (auto: dtype_bytes; q8_0: 34
  bytes per 32 values). With the engine's KV cache groups (a model with
  sliding windows, ``with_kv_cache``) a block is one group's page, so the
  number of blocks follows the engine's, and window layers read at most
  their window per sequence (min(num_kv_tokens, num_seqs * W + num_tokens)).
- ``CalibratedCostModel``: fitted by least squares to timed real steps
  (``cadence.sim.calibrate``), saved as JSON. Either a line,
      t = a + b * num_tokens + c * num_seqs + d * num_kv_tokens   (any subset of features)
  or, the calibration default, a piecewise-linear curve of the token count
  in place of ``a + b * num_tokens`` (``TokenCurve``):
      t = curve(num_tokens) + c * num_seqs + d * num_kv_tokens

A step that computes nothing (only reports finished requests) costs 0.
"""

from __future__ import annotations

import json
from bisect import bisect_left, bisect_right
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from cadence.core.kv_cache.groups import KVCacheLayout, plan_kv_cache_layout
from cadence.core.sched.output import SchedulerOutput

# ---------------------------------------------------------------- step shape


@dataclass(frozen=True, slots=True)
class StepShape:
    """The work of one step, as the cost models read it."""

    num_tokens: int
    num_seqs: int
    num_kv_tokens: int
    num_attn_pairs: int


FEATURES = {
    "tokens": "num_tokens",
    "seqs": "num_seqs",
    "kv_tokens": "num_kv_tokens",
    "attn_pairs": "num_attn_pairs",
}
DEFAULT_FEATURES = ("tokens", "seqs", "kv_tokens")  # the plain linear fit


def feature_values(shape: StepShape, features: Sequence[str]) -> list[float]:
    """The named features of a step, in order (the intercept is not one)."""
    return [float(getattr(shape, FEATURES[name])) for name in features]


def step_shape(scheduler_output: SchedulerOutput) -> StepShape:
    """The shape of a step, from the computed-token counts the scheduler sent."""
    scheduled = scheduler_output.num_scheduled_tokens
    kv = pairs = 0
    for new_req in scheduler_output.scheduled_new_reqs:
        q, c = scheduled[new_req.req_id], new_req.num_computed_tokens
        kv += c + q
        pairs += q * c + q * (q + 1) // 2
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, c in zip(cached.req_ids, cached.num_computed_tokens):
        q = scheduled[req_id]
        kv += c + q
        pairs += q * c + q * (q + 1) // 2
    return StepShape(scheduler_output.total_num_scheduled_tokens, len(scheduled), kv, pairs)


class CostModel(Protocol):
    """What the simulated runner charges for a step."""

    name: str

    def step_seconds(self, shape: StepShape) -> float: ...

    def num_kv_blocks(self, block_size: int) -> int | None:
        """KV-cache blocks the modelled machine holds (None: the caller decides)."""
        ...

    def with_kv_cache(self, kv_cache_dtype: str, groups: bool) -> "CostModel":
        """This model for a cache of ``kv_cache_dtype`` (auto: the model's dtype) kept in the
        engine's KV cache groups where ``groups`` (``kv_cache_layout`` then says which);
        ValueError naming kv_cache_dtype where it cannot price that width."""
        ...

    def kv_cache_layout(self) -> KVCacheLayout | None:
        """The engine's KV cache groups for the modelled model (None: one full-length group)."""
        ...

    def describe(self) -> dict[str, Any]:
        """Everything that sets the costs, for the run's JSON summary."""
        ...


# ---------------------------------------------------------------- hardware


@dataclass(frozen=True)
class HardwareProfile:
    """Peaks of one accelerator (or CPU), and how much of them a step reaches."""

    name: str
    peak_flops: float  # dense FLOP/s in the model's dtype
    mem_bandwidth: float  # bytes/s
    mem_capacity: float  # bytes (weights + KV cache + activations)
    compute_efficiency: float = 0.6
    memory_efficiency: float = 0.8
    step_overhead_s: float = 0.0005  # launch, sampling, host work per step
    dtype_bytes: int = 2
    kv_memory_fraction: float = 0.9  # of capacity, for weights + KV cache
    # A fixed KV-cache budget instead (the CPU engine's default is 1 GiB).
    kv_cache_bytes: float | None = None


# Datasheet peaks (dense bf16, no sparsity). The CPU's are this machine's,
# measured with bench/roofline.py (2 threads, bf16 GEMM 2048^3, tensor sum
# over 512 MiB), rounded; its overhead is mostly Python per step.
PROFILES: dict[str, HardwareProfile] = {
    "h100": HardwareProfile("h100", peak_flops=989e12, mem_bandwidth=3.35e12, mem_capacity=80e9),
    "h200": HardwareProfile("h200", peak_flops=989e12, mem_bandwidth=4.8e12, mem_capacity=141e9),
    # A100 80GB SXM (the PCIe card's HBM is 1.94e12 B/s); the H100's efficiencies.
    "a100": HardwareProfile("a100", peak_flops=312e12, mem_bandwidth=2.0e12, mem_capacity=80e9),
    "cpu": HardwareProfile(
        "cpu", peak_flops=160e9, mem_bandwidth=22e9, mem_capacity=24e9,
        compute_efficiency=0.5, memory_efficiency=0.7, step_overhead_s=0.03,
        kv_cache_bytes=2**30,
    ),
}


# ---------------------------------------------------------------- model shape

LLAMA_3_8B: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
    "vocab_size": 128256, "max_position_embeddings": 8192, "tie_word_embeddings": False,
    "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
}
SMOLLM2_135M: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
    "vocab_size": 49152, "max_position_embeddings": 8192, "tie_word_embeddings": True,
    "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
}
BUILTIN_MODELS = {"llama-3-8b": LLAMA_3_8B, "smollm2-135m": SMOLLM2_135M}


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs of a model."""

    num_params: int
    num_layers: int
    num_heads: int
    head_dim: int
    num_kv_heads: int
    sliding_window: int | None = None  # the window of every layer not in full_attention_layers
    full_attention_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> "ModelShape":
        # cadence.models.config is pure Python (importing the package loads torch).
        from cadence.models.config import ModelConfig

        config = ModelConfig.from_hf_config(hf)
        return cls(
            num_params=config.num_params(),
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            head_dim=config.head_dim,
            num_kv_heads=config.num_key_value_heads,
            sliding_window=config.sliding_window,
            full_attention_layers=tuple(config.full_attention_layers),
        )

    def kv_bytes_per_token(self, dtype_bytes: float) -> int:
        return int(2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes)

    @property
    def num_window_layers(self) -> int:
        return 0 if not self.sliding_window else self.num_layers - len(set(self.full_attention_layers))

    def kv_cache_layout(self) -> KVCacheLayout | None:
        """The engine's KV cache groups (``cadence.core.kv_cache.groups``), None: one group."""
        layout = plan_kv_cache_layout(self.num_layers, self.sliding_window, self.full_attention_layers)
        return layout if layout.is_hybrid else None


# Bytes one cached key or value element takes, by --kv-cache-dtype (q8_0: 34 bytes per 32).
KV_VALUE_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "q8_0": 34 / 32}


def load_model_config(name_or_path: str) -> dict[str, Any]:
    """A built-in model's config dict, or a ``config.json`` file's."""
    if name_or_path in BUILTIN_MODELS:
        return dict(BUILTIN_MODELS[name_or_path])
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ValueError(
            f"model_config: {name_or_path!r} is neither a built-in model "
            f"({', '.join(BUILTIN_MODELS)}) nor a config.json"
        )
    return json.loads(path.read_text())


# ---------------------------------------------------------------- roofline


class RooflineCostModel:
    """Step time = the slower of compute and memory traffic, plus a fixed overhead."""

    def __init__(self, hardware: HardwareProfile, model: ModelShape, *, kv_cache_dtype: str = "auto",
                 kv_cache_groups: bool = False) -> None:
        """``kv_cache_dtype``: the cache's width (auto: the model's dtype, ``dtype_bytes``);
        ``kv_cache_groups``: blocks are the engine's group pages (``kv_cache_layout``), and
        window layers read at most their window."""
        if kv_cache_dtype != "auto" and kv_cache_dtype not in KV_VALUE_BYTES:
            raise ValueError(f"kv_cache_dtype: the roofline prices auto, {', '.join(KV_VALUE_BYTES)}; "
                             f"got {kv_cache_dtype!r}")
        self.hardware = hardware
        self.model = model
        self.name = f"roofline:{hardware.name}"
        self.kv_cache_dtype, self.kv_cache_groups = kv_cache_dtype, kv_cache_groups
        self.weight_bytes = model.num_params * hardware.dtype_bytes
        self._kv_value_bytes = hardware.dtype_bytes if kv_cache_dtype == "auto" else KV_VALUE_BYTES[kv_cache_dtype]
        self.kv_bytes_per_token = model.kv_bytes_per_token(self._kv_value_bytes)
        # a window layer's share of a token's bytes, and its window (reads capped with groups)
        self._window = model.sliding_window if kv_cache_groups and model.num_window_layers else None
        self._window_bytes_per_token = self.kv_bytes_per_token * model.num_window_layers / model.num_layers
        self.flops_per_token = 2 * model.num_params
        self.flops_per_attn_pair = 4 * model.num_layers * model.num_heads * model.head_dim
        self._flops_per_s = hardware.peak_flops * hardware.compute_efficiency
        self._bytes_per_s = hardware.mem_bandwidth * hardware.memory_efficiency

    def flops(self, shape: StepShape) -> float:
        return self.flops_per_token * shape.num_tokens + self.flops_per_attn_pair * shape.num_attn_pairs

    def bytes(self, shape: StepShape) -> float:
        kv = self.kv_bytes_per_token * shape.num_kv_tokens
        if self._window is not None:  # window layers read at most W keys per sequence (a bound)
            window_tokens = min(shape.num_kv_tokens, shape.num_seqs * self._window + shape.num_tokens)
            return self.weight_bytes + (kv - self._window_bytes_per_token * (shape.num_kv_tokens - window_tokens))
        return self.weight_bytes + kv

    def step_seconds(self, shape: StepShape) -> float:
        if not shape.num_tokens:
            return 0.0
        compute = self.flops(shape) / self._flops_per_s
        memory = self.bytes(shape) / self._bytes_per_s
        return max(compute, memory) + self.hardware.step_overhead_s

    def num_kv_blocks(self, block_size: int) -> int:
        """Blocks that fit beside the weights in the usable share of memory."""
        hardware = self.hardware
        free = hardware.kv_cache_bytes
        if free is None:
            free = hardware.mem_capacity * hardware.kv_memory_fraction - self.weight_bytes
        num_blocks = int(free // self.kv_block_bytes(block_size))
        if num_blocks < 1:
            raise ValueError(f"{self.name}: the weights leave no memory for a KV block")
        return num_blocks

    def kv_block_bytes(self, block_size: int) -> float:
        """Bytes of one block of the cache: every layer's, or one group's page."""
        layout = self.kv_cache_layout()
        layers = self.model.num_layers if layout is None else layout.layers_per_group
        return block_size * self.kv_bytes_per_token * layers / self.model.num_layers

    def with_kv_cache(self, kv_cache_dtype: str, groups: bool) -> "RooflineCostModel":
        return RooflineCostModel(self.hardware, self.model, kv_cache_dtype=kv_cache_dtype, kv_cache_groups=groups)

    def kv_cache_layout(self) -> KVCacheLayout | None:
        """A block is one group's page where the cache keeps groups (None: every layer)."""
        return self.model.kv_cache_layout() if self.kv_cache_groups else None

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "hardware": asdict(self.hardware), "model": asdict(self.model),
                "kv_cache_dtype": self.kv_cache_dtype, "kv_cache_groups": self.kv_cache_groups}


# ---------------------------------------------------------------- calibrated

# Token counts where the calibrated curve may bend: matrix-multiply speed
# is not linear in the number of rows (on this CPU a batch of 3 costs more
# than one of 4), so small counts get their own knots.
DEFAULT_TOKEN_KNOTS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class TokenCurve:
    """Seconds as a piecewise-linear function of a step's token count.

    Between knots it interpolates; beyond the ends it extends the end segments.
    """

    knots: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.knots) < 2 or len(self.knots) != len(self.seconds) or list(self.knots) != sorted(set(self.knots)):
            raise ValueError("token_curve: need >= 2 increasing knots, one value each")

    def __call__(self, num_tokens: int) -> float:
        knots = self.knots
        i = min(max(bisect_right(knots, num_tokens) - 1, 0), len(knots) - 2)
        k0, k1 = knots[i], knots[i + 1]
        s0, s1 = self.seconds[i], self.seconds[i + 1]
        return s0 + (s1 - s0) * (num_tokens - k0) / (k1 - k0)

    @staticmethod
    def basis(knots: Sequence[int], num_tokens: int) -> list[float]:
        """Weights of each knot's value at ``num_tokens`` (the curve is linear in its values)."""
        i = min(max(bisect_right(knots, num_tokens) - 1, 0), len(knots) - 2)
        w = (num_tokens - knots[i]) / (knots[i + 1] - knots[i])
        row = [0.0] * len(knots)
        row[i], row[i + 1] = 1.0 - w, w
        return row

    @staticmethod
    def usable_knots(candidates: Sequence[int], token_counts: Sequence[int]) -> tuple[int, ...]:
        """The candidate knots the data can pin down: a knot stays if some step
        lies strictly between its neighbours (or on it, at either end); the
        largest count closes the range."""
        counts = sorted(token_counts)
        largest = counts[-1]
        knots = sorted(k for k in set(candidates) if k < largest) + [largest]
        kept = []
        for i, knot in enumerate(knots):
            lo = knots[i - 1] if i > 0 else knot - 1
            hi = knots[i + 1] if i + 1 < len(knots) else knot + 1
            if bisect_left(counts, hi) > bisect_right(counts, lo):  # a count in (lo, hi)
                kept.append(knot)
        if len(kept) < 2:
            if counts[0] == largest:
                raise ValueError("fit: a token curve needs steps of at least two token counts")
            kept = [counts[0], largest]
        return tuple(kept)


@dataclass
class CalibratedCostModel:
    """``t = intercept + curve(tokens) + sum coefficients[f] * feature_f`` seconds, from real timings.

    Without a token curve it is plain linear (``tokens`` may be a feature);
    with one, the curve replaces the intercept and the ``tokens`` term.
    """

    intercept: float
    coefficients: dict[str, float]
    # Where the fit came from (machine, model, dtype, threads, fit error...).
    meta: dict[str, Any] = field(default_factory=dict)
    kv_blocks: int | None = None
    name: str = "calibrated"
    token_curve: TokenCurve | None = None

    def __post_init__(self) -> None:
        unknown = set(self.coefficients) - set(FEATURES)
        if unknown:
            raise ValueError(f"coefficients: unknown features {sorted(unknown)}; known: {list(FEATURES)}")
        if self.token_curve is not None and "tokens" in self.coefficients:
            raise ValueError("coefficients: tokens is already the token curve's")
        self._terms = [(FEATURES[f], c) for f, c in self.coefficients.items()]

    def step_seconds(self, shape: StepShape) -> float:
        if not shape.num_tokens:
            return 0.0
        t = self.intercept
        if self.token_curve is not None:
            t += self.token_curve(shape.num_tokens)
        for attr, coef in self._terms:
            t += coef * getattr(shape, attr)
        return max(t, 0.0)

    def num_kv_blocks(self, block_size: int) -> int | None:
        if self.kv_blocks is None:
            return None
        calibrated_block = self.meta.get("block_size", block_size)
        return self.kv_blocks * calibrated_block // block_size

    def with_kv_cache(self, kv_cache_dtype: str, groups: bool) -> "CalibratedCostModel":
        """Itself: its timings were fitted on one cache (one group, the calibration's width)."""
        if kv_cache_dtype != "auto":
            raise ValueError("kv_cache_dtype: a calibrated cost model was fitted on one cache width; "
                             "use auto (and size another cache with num_gpu_blocks)")
        return self

    def kv_cache_layout(self) -> KVCacheLayout | None:
        return None

    @classmethod
    def fit(
        cls,
        shapes: Sequence[StepShape],
        seconds: Sequence[float],
        features: Sequence[str] = DEFAULT_FEATURES,
        *,
        token_knots: Sequence[int] | None = None,
        relative: bool = True,
    ) -> "CalibratedCostModel":
        """Least squares over timed steps; ``relative`` weighs each step by 1/t,
        so short decode steps count as much as long prefills. With
        ``token_knots``, the intercept and tokens term become a token curve."""
        import numpy as np

        if token_knots is not None and "tokens" in features:
            raise ValueError("features: tokens is fitted by the token curve; leave it out")
        knots = TokenCurve.usable_knots(token_knots, [s.num_tokens for s in shapes]) if token_knots else ()
        num_coefficients = (len(knots) or 1) + len(features)
        if len(shapes) != len(seconds) or len(shapes) <= num_coefficients:
            raise ValueError("fit: need more timed steps than coefficients")
        if knots:
            x = np.array([[*TokenCurve.basis(knots, s.num_tokens), *feature_values(s, features)] for s in shapes])
        else:
            x = np.array([[1.0, *feature_values(s, features)] for s in shapes])
        y = np.asarray(seconds, dtype=float)
        w = 1.0 / np.maximum(y, 1e-9) if relative else np.ones_like(y)
        solution, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
        rel_err = np.abs(x @ solution - y) / np.maximum(y, 1e-9)
        meta = {
            "num_steps": len(y),
            "mean_abs_rel_error": float(rel_err.mean()),
            "p90_abs_rel_error": float(np.percentile(rel_err, 90)),
        }
        num_base = len(knots) or 1
        coefs = {f: float(c) for f, c in zip(features, solution[num_base:])}
        if knots:
            curve = TokenCurve(knots, tuple(float(v) for v in solution[:num_base]))
            return cls(intercept=0.0, coefficients=coefs, meta=meta, token_curve=curve)
        return cls(intercept=float(solution[0]), coefficients=coefs, meta=meta)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "calibrated",
            "intercept": self.intercept,
            "token_curve": None if self.token_curve is None else {
                "knots": list(self.token_curve.knots), "seconds": list(self.token_curve.seconds)},
            "coefficients": self.coefficients,
            "kv_blocks": self.kv_blocks,
            "meta": self.meta,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "CalibratedCostModel":
        data = json.loads(Path(path).read_text())
        if data.get("kind") != "calibrated":
            raise ValueError(f"{path}: not a calibrated cost model (kind={data.get('kind')!r})")
        return cls(
            intercept=float(data["intercept"]),
            coefficients={k: float(v) for k, v in data["coefficients"].items()},
            meta=data.get("meta", {}),
            kv_blocks=data.get("kv_blocks"),
            name=f"calibrated:{Path(path).name}",
            token_curve=_curve_from_json(data.get("token_curve")),
        )

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, **self.to_json()}


def _curve_from_json(data: dict[str, Any] | None) -> TokenCurve | None:
    if data is None:
        return None
    return TokenCurve(tuple(int(k) for k in data["knots"]), tuple(float(v) for v in data["seconds"]))


# ---------------------------------------------------------------- from a spec


def make_cost_model(spec: str, model_config: str | None = None) -> CostModel:
    """``roofline:h100|h200|a100|cpu`` (with a model config) or ``calibrated:PATH``."""
    kind, _, arg = spec.partition(":")
    if kind == "calibrated":
        if not arg:
            raise ValueError("cost_model: calibrated needs a path, e.g. calibrated:cal.json")
        return CalibratedCostModel.load(arg)
    if kind == "roofline":
        hardware = PROFILES.get(arg)
        if hardware is None:
            raise ValueError(f"cost_model: unknown hardware {arg!r}; known: {', '.join(PROFILES)}")
        model_name = model_config or ("smollm2-135m" if arg == "cpu" else "llama-3-8b")
        return RooflineCostModel(hardware, ModelShape.from_hf_config(load_model_config(model_name)))
    raise ValueError(f"cost_model: expected roofline:HW or calibrated:PATH, got {spec!r}")

