"""C kernels for the CPU, compiled on first use and loaded through ctypes.

The sources live in ``cadence/kernels/csrc`` (one library per ``<name>.c``). Each is
built with the machine's C compiler (``-O3 -march=<arch> -fopenmp``) into a
cache folder, keyed by the sources, the flags and the CPU, so a second
process loads it in milliseconds. ``<arch>`` is ``native`` unless CPU
features are hidden (``cadence.cpu_features``): then it is the generic level
those features allow, so a build for a lesser machine runs on this one:

    $CADENCE_CACHE_DIR (default ~/.cache/cadence)/kernels/<name>-<key>.so

Without a compiler, or with ``CADENCE_NATIVE=0``, ``load`` returns None and
every caller keeps its PyTorch path; nothing else changes.

The libraries link OpenMP's ``libgomp.so.1``. Loaded after torch, the
dynamic loader hands them torch's own copy (same soname), so the kernels run
on torch's threads and honour ``torch.set_num_threads``.

    paged_attention.c   attention of short queries over the paged KV cache
    fused_ops.c         the decoder layer's elementwise steps (RMSNorm, rotary, SiLU-mul)
    quant_matmul.c      products on GGUF's quantized blocks (decoded in registers or per tile)
    decoder_stack.c     a decode step through every decoder layer (includes the three above)
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
# -fassociative-math (with the two it needs) lets the compiler vectorise
# sums; no -ffast-math: it would also assume no inf or NaN.
CFLAGS = (
    "-O3", "-fopenmp", "-fPIC", "-shared",
    "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
)


@functools.cache
def load(name: str, march: str = "native") -> ctypes.CDLL | None:
    """The library built from ``csrc/<name>.c`` for ``-march=<march>``, or None
    (disabled, no compiler, failed build).

    A failed build warns once per process, name and arch.
    """
    if os.environ.get("CADENCE_NATIVE", "1") == "0":
        return None
    try:
        return ctypes.CDLL(str(build(name, march)))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", None) or ""
        warnings.warn(f"cadence: native {name} unavailable ({error}) {detail[-500:]}; "
                      "using the PyTorch path", RuntimeWarning, stacklevel=2)
        return None


def bind(library: ctypes.CDLL, signatures: dict[str, list], restype=ctypes.c_int) -> dict[str, ctypes._CFuncPtr]:
    """The library's functions named in ``signatures`` (name -> argtypes), typed."""
    functions = {}
    for name, argtypes in signatures.items():
        function = getattr(library, name)
        function.restype, function.argtypes = restype, argtypes
        functions[name] = function
    return functions


def build(name: str, march: str = "native") -> Path:
    """Compile ``csrc/<name>.c`` unless the cache already holds this exact build."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc or gcc) on PATH")
    flags = (f"-march={march}", *CFLAGS)
    target = _cache_dir() / f"{name}-{_build_key(compiler, flags)}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        subprocess.run(
            [compiler, *flags, "-o", str(built), str(CSRC / f"{name}.c"), "-lm"],
            check=True, capture_output=True, text=True,
        )
        os.replace(built, target)
    return target


def _build_key(compiler: str, flags: tuple[str, ...]) -> str:
    """Hash of everything a binary depends on: the sources, compiler, flags, CPU."""
    digest = hashlib.sha256()
    for source in sorted(CSRC.glob("*.[ch]")):
        digest.update(source.name.encode())
        digest.update(source.read_bytes())
    digest.update(" ".join((compiler, *flags)).encode())
    digest.update(_cpu_signature().encode())
    return digest.hexdigest()[:16]


def _cpu_signature() -> str:
    """The CPU's model and feature flags (``-march=native`` depends on them).

    All of them, hidden ones included: the hidden set already picked ``march``.
    """
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(lines))


def _cache_dir() -> Path:
    root = os.environ.get("CADENCE_CACHE_DIR") or Path.home() / ".cache" / "cadence"
    return Path(root) / "kernels"
