"""dtype "auto" on the CPU: float32 where GGUF weights stay in their blocks, bfloat16
for float weights only where it is native, and ``CADENCE_RESOLVE_AS`` resolving
defaults as the other machine kind would (issue 31).

Pure functions over fake CPUs (the /proc/cpuinfo excerpts of ``test_cpu_paths``),
plus the load plan's reading of the default model's GGUF header.
"""

from __future__ import annotations

import io

import pytest
import torch

from cadence import cpu_features
from cadence.config import EngineConfig
from cadence.cpu_features import from_cpuinfo, resolved_as, with_hidden
from cadence.runner import load_plan
from cadence.runner.cpu_paths import auto_dtype, emulation_note, resolve_dtype
from tests.runner.test_cpu_paths import EPYC_AVX2, GRAVITON2, GRAVITON3, SAPPHIRE_RAPIDS, SKYLAKE

CPU = torch.device("cpu")
MACHINES = {  # cpuinfo, arch, native bfloat16
    "epyc-avx2": (EPYC_AVX2, "x86_64", False),
    "skylake": (SKYLAKE, "x86_64", False),
    "sapphire-rapids": (SAPPHIRE_RAPIDS, "x86_64", True),
    "graviton3": (GRAVITON3, "aarch64", True),
    "graviton2": (GRAVITON2, "aarch64", False),
}


@pytest.mark.parametrize("machine", list(MACHINES))
def test_kept_blocks_take_float32_and_floats_take_native_bfloat16(machine):
    cpuinfo, arch, native = MACHINES[machine]
    features = from_cpuinfo(cpuinfo, arch)
    dtype, why = auto_dtype(CPU, weights_kept=True, features=features)
    assert dtype == torch.float32 and "float32 activations" in why
    floats = torch.bfloat16 if native else torch.float32
    assert resolve_dtype("auto", CPU, weights_kept=False, features=features) == floats
    # An explicit dtype is never second-guessed.
    assert resolve_dtype("bfloat16", CPU, weights_kept=True, features=features) == torch.bfloat16


@pytest.mark.parametrize("machine", list(MACHINES))
@pytest.mark.parametrize("kind, floats", [("avx2", torch.float32), ("avx512-bf16", torch.bfloat16)])
def test_resolving_as_another_kind(machine, kind, floats):
    cpuinfo, arch, native = MACHINES[machine]
    features = from_cpuinfo(cpuinfo, arch, resolve_as=kind)
    dtype, why = auto_dtype(CPU, features=features)
    assert dtype == floats and cpu_features.RESOLVE_AS_ENV in why and kind in why
    assert resolve_dtype("auto", CPU, weights_kept=True, features=features) == torch.float32
    # Only the defaults move: the paths and the emulation note still read this CPU.
    assert features.native_bf16 == native and features.flags == from_cpuinfo(cpuinfo, arch).flags
    assert (emulation_note(torch.bfloat16, features) is None) == native


def test_resolve_as_survives_hiding_and_is_checked():
    spr = from_cpuinfo(SAPPHIRE_RAPIDS, "x86_64")
    as_avx2 = resolved_as(spr, "avx2")
    assert not as_avx2.defaults_bf16 and as_avx2.native_bf16
    assert with_hidden(as_avx2, "onednn").resolve_as == "avx2"
    assert resolved_as(as_avx2, None).defaults_bf16
    assert "defaults as avx2" in as_avx2.describe()
    with pytest.raises(ValueError, match=cpu_features.RESOLVE_AS_ENV):
        from_cpuinfo(EPYC_AVX2, "x86_64", resolve_as="zen5")


def test_hiding_bf16_resolves_defaults_as_an_avx2_machine():
    """The older switch: hiding bfloat16 gives the AVX2 kind's defaults (and, unlike
    CADENCE_RESOLVE_AS, a generic -march for the C kernels)."""
    hidden = with_hidden(from_cpuinfo(SAPPHIRE_RAPIDS, "x86_64"), "bf16")
    assert resolve_dtype("auto", CPU, features=hidden) == torch.float32
    assert hidden.compiler_arch() == "x86-64-v4"


@pytest.fixture
def fresh_detect():
    cpu_features.detect.cache_clear()
    yield
    cpu_features.detect.cache_clear()


@pytest.mark.parametrize("value, kind", [("avx2", "avx2"), (" AVX512-BF16 ", "avx512-bf16"), ("", None)])
def test_the_environment_variable(monkeypatch, fresh_detect, value, kind):
    monkeypatch.setenv(cpu_features.RESOLVE_AS_ENV, value)
    assert cpu_features.detect().resolve_as == kind


@pytest.mark.parametrize("machine", ["sapphire-rapids", "epyc-avx2"])
def test_the_load_plan_reads_whether_the_default_model_keeps_blocks(monkeypatch, machine):
    cpuinfo, arch, native = MACHINES[machine]
    monkeypatch.setattr(cpu_features, "detect", lambda: from_cpuinfo(cpuinfo, arch))
    assert load_plan.keeps_gguf_blocks(None, "auto") and load_plan.keeps_gguf_blocks(None, "gguf")
    assert not load_plan.keeps_gguf_blocks(None, "none")
    log = io.StringIO()
    assert load_plan.resolve_model_dtype(EngineConfig(), CPU, "auto", log) == torch.float32
    assert log.getvalue().startswith("cadence: dtype auto -> float32: GGUF weights kept in blocks")
    # The same file dequantized at load is float weights: bfloat16 where it is native.
    floats = torch.bfloat16 if native else torch.float32
    assert load_plan.resolve_model_dtype(EngineConfig(), CPU, "none", io.StringIO()) == floats
    assert load_plan.resolve_model_dtype(EngineConfig(dtype="bfloat16"), CPU, "auto", log) == torch.bfloat16
