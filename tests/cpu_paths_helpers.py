"""The CPU paths the suite runs on any machine, by hiding features of this one.

``CPU_PATHS`` names each path and the features hidden to take it; a test
parametrized over them runs the AVX-512, AVX2-only, pre-AVX2, no-oneDNN and
no-C-compiler paths wherever the suite runs (a path this CPU cannot take
anyway is simply the same as a lesser one).
"""

from __future__ import annotations

import pytest

from cadence import cpu_features

CPU_PATHS = {
    "as-is": (),
    "avx2-only": ("avx512", "amx", "avx_ne_convert"),
    "no-avx2": ("avx2",),
    "no-onednn": ("onednn",),
    "no-c-kernels": ("native",),
}


def hide_cpu_features(monkeypatch: pytest.MonkeyPatch, *entries: str) -> cpu_features.CpuFeatures:
    """Make ``cpu_features.detect()`` report this CPU with ``entries`` hidden."""
    real = cpu_features.detect()
    if "avx2" in entries and not real.is_x86:
        pytest.skip("hiding AVX2 is an x86 path")
    hidden = cpu_features.with_hidden(real, *entries)
    monkeypatch.setattr(cpu_features, "detect", lambda: hidden)
    return hidden
