"""The GPU suite: Triton attention, the runner's GPU path, CUDA graphs, memory.

On a machine with CUDA every test runs on the GPU. Without one, the tests
marked ``cuda`` skip, and the rest (the kernel, the runner's Triton path)
run on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``) when
Triton is installed: slow, so they use tiny shapes, but they check the same
kernel code the GPU compiles.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Read when the kernel is first built; set before any test builds it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cadence.kernels.triton_attention import triton_available  # noqa: E402


def pytest_collection_modifyitems(config, items):
    no_triton = pytest.mark.skip(reason="Triton is not installed")
    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "tests/gpu/" not in str(item.fspath).replace(os.sep, "/"):
            continue
        if not triton_available():
            item.add_marker(no_triton)
        elif "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(no_cuda)


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped without one)")


@pytest.fixture(scope="session")
def device():
    return torch.device("cuda" if HAS_CUDA else "cpu")
