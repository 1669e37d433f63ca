"""The compiled kernels' build, cache and fallback (their numerics: test_attention.py)."""

from __future__ import annotations

import platform

import pytest
import torch

from cadence.kernels import build as native_build
from cadence.kernels import paged_attention as native


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty kernel cache, and ``paged_attention()`` forgetting what it loaded."""
    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path))
    native_build.load.cache_clear()
    native.paged_attention.cache_clear()
    yield tmp_path
    native_build.load.cache_clear()
    native.paged_attention.cache_clear()


def _needs_compiler():
    if native.paged_attention() is None:
        pytest.skip("no C compiler: the native kernel is unavailable")


def test_builds_once_into_the_cache(fresh_cache):
    _needs_compiler()
    built = sorted((fresh_cache / "kernels").glob("paged_attention-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    assert native_build.build("paged_attention") == built[0]  # found, not rebuilt
    assert built[0].stat().st_mtime_ns == mtime


def test_disabled_by_environment(fresh_cache, monkeypatch):
    monkeypatch.setenv("CADENCE_NATIVE", "0")
    assert native.paged_attention() is None
    assert not (fresh_cache / "kernels").exists()


def test_a_failed_build_falls_back_with_a_warning(fresh_cache, monkeypatch):
    monkeypatch.setenv("CC", str(fresh_cache / "no-such-compiler"))
    with pytest.warns(RuntimeWarning, match="PyTorch path"):
        assert native.paged_attention() is None


def test_rejects_tensors_it_cannot_read():
    _needs_compiler()
    kernel = native.paged_attention()
    q = torch.zeros(2, 4, 8)
    cache = torch.zeros(4, 2, 2, 8)
    index = dict(query_start=torch.tensor([0, 1]), query_len=torch.tensor([1, 1]),
                 seq_len=torch.tensor([1, 1]), block_table=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="must be contiguous CPU tensors"):
        kernel(q.bfloat16(), cache, cache, q, **index, sliding_window=None, scale=1.0)
    with pytest.raises(ValueError, match="must be contiguous CPU tensors"):
        kernel(q, cache, cache.half(), q, **index, sliding_window=None, scale=1.0)
    with pytest.raises(ValueError, match="no kernel for torch.bfloat16 queries over a torch.float16 cache"):
        kernel(q.bfloat16(), cache.half(), cache.half(), q.bfloat16(), **index, sliding_window=None, scale=1.0)
    with pytest.raises(ValueError, match="int32"):
        kernel(q, cache, cache, torch.empty_like(q), **{**index, "block_table": index["block_table"].long()},
               sliding_window=None, scale=1.0)
    assert not kernel.supports(torch.float16)


def test_the_cpu_runner_uses_it():
    _needs_compiler()
    from cadence import cpu_features

    if not cpu_features.detect().allows("native"):
        pytest.skip("C kernels hidden (CADENCE_HIDE_CPU_FEATURES=native): the runner rightly skips them")
    from cadence.runner.cpu_paths import choose_cpu_paths

    assert choose_cpu_paths(torch.float32).attention_kernel is not None
    assert choose_cpu_paths(torch.bfloat16).attention_kernel is not None
    assert choose_cpu_paths(torch.float16).attention_kernel is None


def test_a_build_for_a_lesser_machine_has_its_own_cache_entry(fresh_cache):
    _needs_compiler()
    generic = "x86-64-v2" if platform.machine() in ("x86_64", "AMD64") else "armv8-a"
    assert native.paged_attention(generic) is not None
    assert len(list((fresh_cache / "kernels").glob("paged_attention-*.so"))) == 2
