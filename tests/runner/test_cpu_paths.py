"""CPU probing, dtype "auto", and every CPU path computing the same tokens.

The machine classes below are real /proc/cpuinfo excerpts (flags trimmed to
the ones that pick paths); the runner tests take every path on this machine
by hiding its features (``cpu_paths_helpers``).
"""

from __future__ import annotations

import pytest
import torch

from cadence import cpu_features
from cadence.cpu_features import from_cpuinfo, with_hidden
from cadence.runner.cpu_paths import CpuPaths, choose_cpu_paths, emulation_note, resolve_dtype
from cadence.runner.model_runner import ModelRunner
from cadence.models.testing import random_model, tiny_config
from tests.cpu_paths_helpers import CPU_PATHS, hide_cpu_features
from tests.runner.test_model_runner import BLOCK_SIZE, NUM_BLOCKS, HandScheduler, dense_greedy, prompt_of

X86_BASE = "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt cx16 movbe"
EPYC_AVX2 = f"model name\t: AMD EPYC 7B12\nflags\t\t: {X86_BASE} avx avx2 fma f16c bmi1 bmi2 abm\n"
SKYLAKE = (f"model name\t: Intel(R) Xeon(R) Platinum 8175M\nflags\t\t: {X86_BASE} avx avx2 fma f16c "
           "bmi1 bmi2 abm avx512f avx512dq avx512cd avx512bw avx512vl\n")
SAPPHIRE_RAPIDS = (f"model name\t: Intel(R) Xeon(R) Platinum 8488C\nflags\t\t: {X86_BASE} avx avx2 fma "
                   "f16c bmi1 bmi2 abm avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 "
                   "avx512_fp16 amx_bf16 amx_tile amx_int8\n")
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes crc32 asimdhp sve bf16 i8mm\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes crc32 asimdhp\n"


@pytest.mark.parametrize("cpuinfo, arch, native_bf16, onednn_bf16, auto, march", [
    (EPYC_AVX2, "x86_64", False, False, torch.float32, "native"),
    (SKYLAKE, "x86_64", False, True, torch.float32, "native"),
    (SAPPHIRE_RAPIDS, "x86_64", True, True, torch.bfloat16, "native"),
    (GRAVITON3, "aarch64", True, True, torch.bfloat16, "native"),
    (GRAVITON2, "aarch64", False, False, torch.float32, "native"),
    ("", "arm64", False, False, torch.float32, "native"),  # no /proc/cpuinfo (macOS)
])
def test_machine_classes(cpuinfo, arch, native_bf16, onednn_bf16, auto, march):
    features = from_cpuinfo(cpuinfo, arch)
    assert features.native_bf16 == native_bf16
    assert features.onednn_bf16 == onednn_bf16
    assert features.compiler_arch() == march
    assert resolve_dtype("auto", torch.device("cpu"), features=features) == auto
    assert (emulation_note(torch.bfloat16, features) is None) == native_bf16


def test_hiding_makes_a_lesser_machine():
    spr = from_cpuinfo(SAPPHIRE_RAPIDS, "x86_64")
    assert not spr.hidden
    as_avx2 = with_hidden(spr, "avx512")
    # AMX never comes without AVX-512, so it goes too: an AVX2 machine with AVX-512's bf16 is no real CPU.
    assert not as_avx2.native_bf16 and not as_avx2.onednn_bf16
    assert as_avx2.has("avx2") and not any(f.startswith(("avx512", "amx")) for f in as_avx2.flags)
    assert as_avx2.compiler_arch() == "x86-64-v3"
    assert with_hidden(spr, "avx2").compiler_arch() == "x86-64-v2"
    assert with_hidden(spr, "bf16").compiler_arch() == "x86-64-v4"
    assert not with_hidden(spr, "bf16").native_bf16
    assert with_hidden(from_cpuinfo(GRAVITON3, "aarch64"), "bf16").compiler_arch() == "armv8.2-a"
    # The environment variable's form: comma-separated, case and spaces ignored.
    assert from_cpuinfo(SAPPHIRE_RAPIDS, "x86_64", hide=" AVX512 , amx").flags == as_avx2.flags
    # Pseudo-features switch paths off without changing the build.
    assert with_hidden(spr, "onednn", "native").compiler_arch() == "native"


def test_resolve_dtype_explicit_and_gpu():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("float16", cpu) == torch.float16
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("float8", cpu)
    # On a GPU, "auto" keeps a half-precision checkpoint's dtype and halves float32.
    assert resolve_dtype("auto", cuda, checkpoint_dtype=torch.bfloat16, cuda_bf16=True) == torch.bfloat16
    assert resolve_dtype("auto", cuda, checkpoint_dtype=torch.float16, cuda_bf16=True) == torch.float16
    assert resolve_dtype("auto", cuda, checkpoint_dtype=torch.float32, cuda_bf16=True) == torch.bfloat16
    assert resolve_dtype("auto", cuda, checkpoint_dtype=None, cuda_bf16=False) == torch.float16
    assert resolve_dtype("auto", cuda, checkpoint_dtype=torch.bfloat16, cuda_bf16=False) == torch.float16


@pytest.mark.parametrize("hidden, packs, kernels", [
    ((), None, None),
    (("onednn",), False, None),
    (("native",), None, False),
    (("onednn", "native"), False, False),
])
def test_paths_follow_what_is_hidden(hidden, packs, kernels):
    features = with_hidden(cpu_features.detect(), *hidden)
    paths = choose_cpu_paths(torch.float32, features)
    if packs is not None:
        assert paths.pack_weights is packs
        assert "hidden" in paths.reasons[0]
    if kernels is not None:
        assert (paths.fused_ops is None) and (paths.attention_kernel is None)
        assert "C kernels hidden" in paths.reasons[1]
    # bfloat16 is never packed where oneDNN cannot do it, whatever else is visible.
    no_bf16 = with_hidden(cpu_features.detect(), "avx512", "avx_ne_convert", "bf16")
    assert not choose_cpu_paths(torch.bfloat16, no_bf16).pack_weights
    # float16 has no fast path on the CPU: plain PyTorch, said so.
    half = choose_cpu_paths(torch.float16, features)
    assert not half.pack_weights and half.attention_kernel is None


def runner_on(model, dtype, paths=None):
    return ModelRunner(model, model.config, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, dtype=dtype,
                       max_num_seqs=8, max_model_len=256, cpu_paths=paths)


def greedy_through_runner(runner, prompt, num_tokens):
    sched = HandScheduler(runner)
    sched.add("a", prompt)
    sched.step({"a": 5})
    sched.step({"a": len(prompt) - 5})
    sched.decode(num_tokens - 1)
    return sched.outputs("a")


@pytest.mark.parametrize("path", list(CPU_PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_path_gives_the_dense_greedy_tokens(monkeypatch, path, dtype):
    hide_cpu_features(monkeypatch, *CPU_PATHS[path])
    model = random_model(tiny_config(), dtype=dtype, seed=0)
    prompt = prompt_of(20, 12)
    expected = dense_greedy(model, prompt, 6)  # before packing: the plain model
    runner = runner_on(model, dtype)
    if path == "no-onednn":
        assert not runner.cpu_paths.pack_weights
    if path == "no-c-kernels":
        assert runner.attention_kernel is None
    assert greedy_through_runner(runner, prompt, 6) == expected


def test_float16_runs_on_plain_pytorch():
    model = random_model(tiny_config(), dtype=torch.float16, seed=0)
    prompt = prompt_of(21, 12)
    expected = dense_greedy(model, prompt, 6)
    runner = runner_on(model, torch.float16)
    assert runner.attention_kernel is None and not runner.cpu_paths.pack_weights
    assert greedy_through_runner(runner, prompt, 6) == expected


def test_plain_paths_by_request():
    model = random_model(tiny_config(), seed=0)
    runner = runner_on(model, torch.float32, CpuPaths.plain())
    assert runner.attention_kernel is None
    assert model.model.layers[0].mlp.down_proj.packed_weight is None
