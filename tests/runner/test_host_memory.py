"""glibc malloc tuning: freed load transients go back to the kernel when asked."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from cadence.models.step_buffer import StepBuffer
from cadence.runner.host_memory import return_freed_memory

SCRIPT = """
import sys
from cadence.runner.host_memory import keep_freed_memory, return_freed_memory

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) / 1024

assert keep_freed_memory()  # as the runner does: freed memory stays in the heap
chunks = [bytearray(b"x" * (64 << 10)) for _ in range(3200)]  # 200 MiB of heap chunks
top = bytearray(b"x" * (64 << 10))  # still live above them: the heap cannot shrink from its top
before = rss_mib()
del chunks
kept = rss_mib()
assert return_freed_memory()
after = rss_mib()
print(before, kept, after)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_heap_pages_stay_until_returned():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True)
    before, kept, after = map(float, result.stdout.split())
    assert kept > before - 20  # keep_freed_memory: nothing went back by itself
    assert after < kept - 150  # return_freed_memory: the 200 MiB did


def test_a_step_buffer_keeps_its_rows_until_the_engine_idles():
    buffer = StepBuffer()
    first = buffer.rows(4, 8)
    assert first.shape == (4, 8) and first.is_contiguous() and first.dtype == torch.float32
    assert buffer.rows(2, 8).data_ptr() == first.data_ptr()  # fewer rows: the same memory
    more = buffer.rows(6, 8)  # more rows: a larger tensor, kept from now on
    assert more.shape == (6, 8) and buffer.rows(5, 8).data_ptr() == more.data_ptr()
    assert buffer.rows(5, 9).shape == (5, 9)  # another width: another tensor
    return_freed_memory()  # an idle engine's call drops every step buffer
    assert buffer._data is None
    assert buffer.rows(1, 3).shape == (1, 3)  # and the next step takes one again
