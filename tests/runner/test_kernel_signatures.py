"""Every ctypes binding declares exactly the C prototype it calls.

A mismatch (an int passed where the C side reads int64_t, a missing
argument) is silent memory corruption, not an error, so the sources are
preprocessed (the kernels are generated per element type by macros) and
each exported function's parameter list is compared with its argtypes.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import pytest

from cadence.kernels import build, decoder_stack, fused_ops, paged_attention, quant_matmul

C_TO_CTYPES = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float}
ELEMENT_SUFFIXES = ("f32", "bf16")


def exported_prototypes(source: str) -> dict[str, list[type]]:
    """name -> ctypes of its parameters, for every non-static function defined in ``source``."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to preprocess the kernels")
    expanded = subprocess.run(
        [compiler, "-E", "-P", "-fopenmp", str(build.CSRC / source)],
        check=True, capture_output=True, text=True,
    ).stdout
    expanded = re.sub(r"\s+", " ", expanded)
    prototypes = {}
    # The declaration runs from the end of the previous one; "static" in it means not exported.
    for match in re.finditer(r"([^;{}]*)\b(?:void|int|int64_t) (\w+)\(([^)]*)\) \{", expanded):
        if re.search(r"\bstatic\b", match.group(1)):
            continue
        params = match.group(3).strip()
        prototypes[match.group(2)] = [] if params in ("", "void") else [_ctype(p) for p in params.split(",")]
    return prototypes


def _ctype(param: str) -> type:
    if "*" in param:
        return ctypes.c_void_p
    base = param.replace("const", "").split()[0]
    return C_TO_CTYPES[base]


def test_fused_ops_bindings_match_their_prototypes():
    prototypes = exported_prototypes("fused_ops.c")
    expected = {f"{name}_{suffix}": argtypes
                for name, argtypes in fused_ops.SIGNATURES.items() for suffix in ELEMENT_SUFFIXES}
    expected |= fused_ops.MOE_SIGNATURES  # float32 only
    expected["argmax_rows_f32"] = fused_ops.ARGMAX_SIGNATURE
    assert set(prototypes) == set(expected)
    for name, argtypes in expected.items():
        assert prototypes[name] == argtypes, name


def test_paged_attention_binding_matches_its_prototype():
    prototypes = exported_prototypes("paged_attention.c")
    assert set(prototypes) == {f"paged_attention_{suffix}" for suffix in paged_attention.SUFFIXES.values()}
    assert {"f32", "bf16", "f32_kvf16", "f32_kvbf16"} <= set(paged_attention.SUFFIXES.values())
    for name, params in prototypes.items():
        assert params == paged_attention.ARGTYPES, name


def test_quant_matmul_bindings_match_their_prototypes():
    prototypes = exported_prototypes("quant_matmul.c")
    assert prototypes == quant_matmul.SIGNATURES


def test_decoder_stack_bindings_match_their_prototypes():
    # The file includes the other kernels' sources: its own functions are the decoder_ ones.
    prototypes = {name: params for name, params in exported_prototypes("decoder_stack.c").items()
                  if name.startswith("decoder_")}
    assert prototypes == decoder_stack.SIGNATURES


def test_the_parser_sees_a_wrong_binding():
    prototypes = exported_prototypes("fused_ops.c")
    wrong = [ctypes.c_int if t is ctypes.c_int64 else t for t in fused_ops.SIGNATURES["silu_mul"]]
    assert prototypes["silu_mul_f32"] != wrong
