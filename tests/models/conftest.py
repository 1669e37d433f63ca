"""Shared set-up for the model tests: offline, two threads, float32 determinism."""

import os

# transformers is a test-only reference here; it must never reach a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import torch  # noqa: E402

torch.set_num_threads(2)
