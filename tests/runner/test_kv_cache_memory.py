"""The CPU's KV cache takes memory as blocks are first written, not when it is made.

Each check runs in a fresh process and reads its VmRSS, so nothing else this
test session has allocated (or freed) moves the figures. The caches are
512 MiB; a cache touched at allocation grows RSS by all of it, a lazy one by
the few blocks written, so the bounds below leave a wide margin either way.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")

CACHE_MIB = 512
BOUND_MIB = 96  # growth allowed for the blocks written, a tiny model and its start-up

RSS = """
def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) / 1024
"""

CACHE_SCRIPT = RSS + """
import torch
from cadence.runner.kv_cache import PagedKVCache

for dtype in (torch.float32, torch.float16, torch.bfloat16):
    num_blocks = (512 << 20) // (2 * 2 * 16 * 2 * 64 * dtype.itemsize)
    before = rss_mib()
    cache = PagedKVCache.allocate(num_layers=2, num_blocks=num_blocks, block_size=16, num_kv_heads=2,
                                  head_dim=64, dtype=dtype)
    made = rss_mib()
    for layer in range(2):
        k = torch.ones(64, 2, 64)
        cache.write(layer, k, k, torch.arange(64))  # blocks 0-3
    written = rss_mib()
    assert cache.data.nbytes == 512 << 20
    assert cache.keys(0)[4:].abs().amax() == 0 and cache.keys(1)[:4].abs().amin() == 1
    print(made - before, written - before)
    del cache
"""

ENGINE_SCRIPT = RSS + """
import io
import torch
from cadence.config import EngineOptions
from cadence.core.request import Request
from cadence.engine.builder import assemble_engine
from cadence.models.testing import random_model, tiny_config
from cadence.sampling_params import SamplingParams

torch.set_num_threads(1)
model = random_model(tiny_config(head_dim=64), seed=0)  # 2 layers x 2 KV heads: 32 KiB a block
options = EngineOptions.from_kwargs(device="cpu", dtype="float32", kv_cache_memory="512MiB",
                                    max_model_len=256)
before = rss_mib()
engine = assemble_engine(options, model, model.config, None, log=io.StringIO())
built = rss_mib()
core = engine.core
core.add_request(Request("a", list(range(3, 103)), SamplingParams(temperature=0.0, max_tokens=16)))
while core.has_work():
    core.step()
print(built - before, rss_mib() - before)
"""


def run(script: str) -> list[float]:
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    return [float(x) for x in result.stdout.split()]


def test_a_cache_takes_memory_as_blocks_are_written_in_every_dtype():
    growth = run(CACHE_SCRIPT)
    assert len(growth) == 6
    assert all(g < BOUND_MIB for g in growth), growth  # of a 512 MiB cache each


def test_an_engine_with_a_large_cache_grows_by_the_blocks_its_request_writes():
    built, served = run(ENGINE_SCRIPT)
    assert built < BOUND_MIB and served < BOUND_MIB, (built, served)  # of a 512 MiB cache
