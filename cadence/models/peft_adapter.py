"""LoRA adapters in PEFT's format: a folder with ``adapter_config.json`` and
``adapter_model.safetensors`` (what ``PeftModel.save_pretrained`` writes).

    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight   A [r, in]
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight   B [out, r]

The delta of a projection is ``scaling * B @ A``, ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``). Only plain LoRA on the
decoder's seven projections is read; anything else (DoRA, trained biases,
extra saved modules, per-module ranks) is refused with the option's name,
never silently dropped. Every error is a ``ValueError`` starting with
``lora_path:`` (the field a client gave).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# PEFT key -> (module name in the base model, "A" or "B"); an adapter name may sit before .weight.
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<kind>[AB])(?:\.[^.]+)?\.weight$")
# Options that change what the adapter computes; the value that means "plain LoRA".
_PLAIN_LORA = {"use_dora": False, "bias": "none", "modules_to_save": None, "rank_pattern": {},
               "alpha_pattern": {}, "layer_replication": None, "fan_in_fan_out": False,
               "lora_bias": False, "use_qalora": False}


@dataclass(frozen=True)
class PeftAdapter:
    """One adapter's weights, by the Hugging Face name of the projection they adapt."""

    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A [r, in], B [out, r])


def load_peft_adapter(path: str, *, max_rank: int, dtype: torch.dtype) -> PeftAdapter:
    """Read and check a PEFT folder; weights cast to ``dtype`` (the model's)."""
    config = read_adapter_config(path, max_rank=max_rank)
    from safetensors.torch import load_file

    try:
        tensors = load_file(os.path.join(path, WEIGHTS_FILE))
    except Exception as err:  # a truncated or foreign file: the client's input
        raise ValueError(f"lora_path: cannot read {WEIGHTS_FILE} in {path!r}: {err}") from None
    weights = _pair_tensors(tensors, dtype)
    rank = int(config["r"])
    for module, (a, b) in weights.items():
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"lora_path: {module} has lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)}, not rank r={rank} of {CONFIG_FILE}")
    return PeftAdapter(rank, adapter_scaling(config), weights)


def read_adapter_config(path: str, *, max_rank: int) -> dict:
    """``adapter_config.json`` of a plain LoRA adapter no wider than ``max_rank``."""
    if not isinstance(path, str) or not os.path.isdir(path):
        raise ValueError(f"lora_path: no such folder: {path!r}")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not os.path.isfile(os.path.join(path, name)):
            raise ValueError(f"lora_path: {path!r} has no {name} (a PEFT adapter folder has "
                             f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        with open(os.path.join(path, CONFIG_FILE)) as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"lora_path: cannot read {CONFIG_FILE}: {err}") from None
    _check_plain_lora(config)
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora_path: {CONFIG_FILE} has no valid rank r ({rank!r})")
    if rank > max_rank:
        raise ValueError(f"lora_path: the adapter's rank {rank} exceeds max_lora_rank {max_rank} "
                         "(start the engine with a larger --max-lora-rank)")
    return config


def adapter_scaling(config: dict) -> float:
    """``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA (PEFT's rule)."""
    rank = config["r"]
    alpha = config.get("lora_alpha", 8)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _check_plain_lora(config: dict) -> None:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"lora_path: peft_type {peft_type!r} is not LoRA")
    for name, plain in _PLAIN_LORA.items():
        value = config.get(name, plain)
        if value not in (plain, None) and value != {} and value != []:
            raise ValueError(f"lora_path: {CONFIG_FILE} sets {name}={value!r}, "
                             "which cadence does not support (plain LoRA only)")


def _pair_tensors(tensors: dict[str, torch.Tensor], dtype: torch.dtype
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module -> (A, B) from PEFT's keys; refuses keys of other kinds and unpaired halves."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"lora_path: unsupported tensor {key!r} (only lora_A/lora_B weights "
                             f"of {', '.join(TARGET_MODULES)})")
        module = match.group("module")
        if module.rpartition(".")[2] not in TARGET_MODULES:
            raise ValueError(f"lora_path: target module {module!r} is not supported (supported: "
                             f"{', '.join(TARGET_MODULES)})")
        halves.setdefault(module, {})[match.group("kind")] = tensor.to(dtype)
    if not halves:
        raise ValueError(f"lora_path: {WEIGHTS_FILE} holds no LoRA weights")
    for module, pair in halves.items():
        if len(pair) != 2:
            raise ValueError(f"lora_path: {module} has lora_{next(iter(pair))} without its other half")
    return {module: (pair["A"], pair["B"]) for module, pair in halves.items()}
