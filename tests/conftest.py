"""Test-wide set-up: offline. ``tests`` is a package: helpers are imported as
``tests.core.fakes``, ``tests.server.serverlib``, ``tests.hf_reference``, ..."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
