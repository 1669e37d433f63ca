"""Load a Llama-family model from a Hugging Face folder.

The folder holds ``config.json`` and the weights as ``*.safetensors``: one file,
or several listed by ``model.safetensors.index.json``. Tensors are read one at
a time (memory-mapped) and cast to the requested dtype as they are copied in.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Iterator

import torch
from safetensors import safe_open

from cadence.models.config import ModelConfig
from cadence.models.llama import LlamaForCausalLM

_INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(path: str) -> ModelConfig:
    """``ModelConfig`` from config.json; generation_config.json adds stop ids."""
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{config_path!r} not found: {path!r} is not a Hugging Face model folder")
    config = ModelConfig.from_hf_config(_read_json(config_path))
    generation = _read_optional_json(os.path.join(path, "generation_config.json"))
    extra_eos = generation.get("eos_token_id")
    if extra_eos is None:
        return config
    extra = (extra_eos,) if isinstance(extra_eos, int) else tuple(extra_eos)
    return config.replace(eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids + extra)))


def load_hf_model(path: str, dtype: torch.dtype = torch.float32) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model in folder ``path`` with weights in ``dtype``."""
    config = read_hf_config(path)
    model = LlamaForCausalLM(config, dtype)
    model.load_weights(_named_tensors(safetensors_files(path)))
    return model.eval(), config


def safetensors_files(path: str) -> list[str]:
    """The weight files of a folder, from its index when it has one."""
    index_path = os.path.join(path, _INDEX_FILE)
    if os.path.exists(index_path):
        weight_map = _read_json(index_path)["weight_map"]
        return [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path!r}")
    return files


def _named_tensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _read_optional_json(path: str) -> dict[str, Any]:
    return _read_json(path) if os.path.exists(path) else {}
