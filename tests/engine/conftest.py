"""tests/engine: the detokenizer, the output processor and the ``LLM`` API.

Offline and on two threads; the default model's tokenizer is read once per
session (cheap: metadata only), the model itself by the modules that need it.
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from cadence.models import Tokenizer, default_model_path  # noqa: E402
from cadence.models.gguf_loader import read_gguf  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    """The default model's tokenizer (SmolLM2: byte-level BPE, 17 special tokens)."""
    return Tokenizer.from_gguf_metadata(read_gguf(default_model_path())[1])
