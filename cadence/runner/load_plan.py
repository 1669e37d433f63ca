"""Before the model loads: on which device, in which dtype, which GGUF blocks kept.

``build_engine`` asks ``plan_load`` and loads what it says; every choice
that depends on the device or the CPU is made here (the rules themselves
are ``cadence.runner.cpu_paths``'s), each ``auto`` said in one log line:

    device         auto: cuda where torch sees a GPU, else cpu
    quantization   resolve_quantization (auto keeps GGUF blocks on a CPU whose
                   kernel builds); dense where tensor_parallel_size > 1
    dtype          auto_dtype: on the CPU it reads whether the loader keeps
                   blocks (the GGUF header), on a GPU the checkpoint's own dtype
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TextIO

import torch

from cadence.config import EngineConfig, EngineOptions
from cadence.models import checkpoint_dtype
from cadence.models.default_model import default_model_path
from cadence.models.gguf_loader import read_gguf
from cadence.models.quantized import keeps_quantized
from cadence.runner.cpu_paths import auto_dtype, resolve_dtype, resolve_quantization


@dataclass(frozen=True)
class LoadPlan:
    """Load the model onto ``device`` in ``dtype``, GGUF blocks kept as ``quantization`` says."""

    device: torch.device
    dtype: torch.dtype
    quantization: str


def plan_load(options: EngineOptions, *, log: TextIO = sys.stderr) -> LoadPlan:
    """The device, dtype and loader mode for ``options``; logs a fallback and ``dtype`` auto."""
    engine_config = options.engine
    device = resolve_device(engine_config.device)
    quantization, note = resolve_quantization(engine_config.quantization, device)
    size = options.parallel.tensor_parallel_size
    if size > 1 and quantization != "none":
        quantization, note = _dense_for_tensor_parallel(engine_config.quantization, size)
    if note is not None:
        print(f"cadence: {note}", file=log)
    dtype = resolve_model_dtype(engine_config, device, quantization, log)
    return LoadPlan(device, dtype, quantization)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _dense_for_tensor_parallel(option: str, size: int) -> tuple[str, str]:
    """The loader's mode when ranks split the weights: dense (auto), or refused (gguf)."""
    if option == "gguf":
        raise ValueError(f"quantization: gguf keeps weights quantized, which tensor_parallel_size "
                         f"{size} does not split; use auto or none")
    return "none", f"quantization auto: GGUF weights dequantized at load (tensor_parallel_size {size})"


def resolve_model_dtype(engine_config: EngineConfig, device: torch.device, quantization: str,
                        log: TextIO) -> torch.dtype:
    """The dtype option made concrete, ``auto`` said why in one line: it reads whether the
    loader keeps GGUF blocks (CPU) or the checkpoint's own dtype (GPU)."""
    if engine_config.dtype != "auto":
        return resolve_dtype(engine_config.dtype, device)
    stored = checkpoint_dtype(engine_config.model) if device.type == "cuda" else None
    kept = device.type == "cpu" and keeps_gguf_blocks(engine_config.model, quantization)
    dtype, why = auto_dtype(device, checkpoint_dtype=stored, weights_kept=kept)
    print(f"cadence: dtype auto -> {dtype_name(dtype)}: {why}", file=log)
    return dtype


def keeps_gguf_blocks(path: str | None, quantization: str) -> bool:
    """Whether the loader keeps some matmul weight of ``path`` in its GGUF blocks under
    ``quantization`` (the rule of ``load_gguf_model``: matrices, and stacked experts, that
    ``keeps_quantized`` takes)."""
    path = default_model_path() if path is None else path
    if quantization == "none" or not path.endswith(".gguf"):
        return False
    reader, _ = read_gguf(path)
    return any(len(t.shape) in (2, 3) and keeps_quantized(t.name, t.tensor_type, quantization)
               for t in reader.tensors)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``float32``, as options and log lines spell it."""
    return str(dtype).removeprefix("torch.")
