"""What this CPU can do, read once per process, with features hidden on request.

Machines of one kind differ (AVX-512 with bfloat16 and AMX on some, only
AVX2 on others, ARM elsewhere), so every CPU fast path is chosen from this
record, never assumed. Pure Python: the flags come from ``/proc/cpuinfo``
(x86 ``flags``, ARM ``Features``).

Hiding features makes a machine act as a lesser one, so the test suite can
run every path on any CPU:

    CADENCE_HIDE_CPU_FEATURES=avx512,amx   # act as an AVX2-only x86
    CADENCE_HIDE_CPU_FEATURES=bf16         # no native bfloat16 arithmetic
    CADENCE_HIDE_CPU_FEATURES=onednn       # no oneDNN packed matmuls
    CADENCE_HIDE_CPU_FEATURES=native       # no C kernels (as CADENCE_NATIVE=0)

Each entry hides every flag equal to it or starting with it (``avx512``
hides ``avx512f``, ``avx512bw``, ``avx512_bf16``, ...), and what no real CPU
has without it (``avx2`` hides AVX-512 and AMX too, ``avx512`` hides AMX);
``bf16`` hides every flag that gives native bfloat16 arithmetic. A hidden
feature can only be taken away, never added.

Resolving defaults as the other machine kind would is a second switch, so
the suite can pass on either kind of machine whichever kind CI gets:

    CADENCE_RESOLVE_AS=avx512-bf16   # defaults as on a CPU with native bfloat16
    CADENCE_RESOLVE_AS=avx2          # defaults as on a CPU without it

It changes only what the defaults resolve to (``dtype="auto"``, through
``defaults_bf16``), never which paths run: on an AVX2 machine resolved as
``avx512-bf16`` a float checkpoint's ``auto`` is bfloat16, computed in
software. On the greater machine, hiding does the reverse and more
(``CADENCE_HIDE_CPU_FEATURES=bf16`` resolves as a CPU without native
bfloat16 and builds the C kernels for x86-64-v4; ``avx512,amx`` takes the
AVX2 machine's paths too).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

HIDE_ENV = "CADENCE_HIDE_CPU_FEATURES"
RESOLVE_AS_ENV = "CADENCE_RESOLVE_AS"
# The machine kinds defaults can resolve as, and whether each computes bfloat16 natively.
RESOLVE_KINDS = {"avx2": False, "avx512-bf16": True}
# Not CPU flags, but paths the suite switches off the same way.
PSEUDO_FEATURES = ("onednn", "native")
# Flags that mean the CPU computes bfloat16 products natively.
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "avx_ne_convert", "bf16")
# oneDNN's bfloat16 reorder needs one of these on x86 (torch's own check).
_ONEDNN_BF16_X86 = (("avx512bw", "avx512vl", "avx512dq"), ("avx_ne_convert",))
# Hiding a feature hides what no real CPU has without it.
_IMPLIED = {"avx2": ("avx512", "amx", "avx_ne_convert", "avx_vnni"), "avx512": ("amx",)}
# gcc's x86-64 micro-architecture levels, best first, and the flags each needs.
_X86_LEVELS = (
    ("x86-64-v4", ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")),
    ("x86-64-v3", ("avx2", "bmi1", "bmi2", "fma", "f16c", "movbe", "abm")),
    ("x86-64-v2", ("sse4_2", "popcnt", "ssse3", "cx16")),
)


@dataclass(frozen=True)
class CpuFeatures:
    """This CPU's architecture, model and visible feature flags."""

    arch: str  # platform.machine(): x86_64, aarch64, arm64, ...
    model_name: str
    flags: frozenset[str]  # visible flags (hidden ones removed)
    hidden: frozenset[str] = frozenset()  # the entries of CADENCE_HIDE_CPU_FEATURES
    resolve_as: str | None = None  # CADENCE_RESOLVE_AS: a key of RESOLVE_KINDS, or None (this CPU)

    def __post_init__(self) -> None:
        if self.resolve_as is not None and self.resolve_as not in RESOLVE_KINDS:
            raise ValueError(f"{RESOLVE_AS_ENV}: must be one of {', '.join(RESOLVE_KINDS)}, "
                             f"got {self.resolve_as!r}")

    @property
    def is_x86(self) -> bool:
        return self.arch in ("x86_64", "amd64", "AMD64", "i686")

    @property
    def is_arm(self) -> bool:
        return self.arch in ("aarch64", "arm64")

    def has(self, *flags: str) -> bool:
        """Whether every one of ``flags`` is visible."""
        return all(flag in self.flags for flag in flags)

    @property
    def native_bf16(self) -> bool:
        """bfloat16 products in hardware (AVX512_BF16, AMX, AVX-NE-CONVERT, ARM BF16)."""
        return any(flag in self.flags for flag in BF16_FLAGS)

    @property
    def defaults_bf16(self) -> bool:
        """Whether defaults resolve as on a CPU with native bfloat16: ``native_bf16``
        unless ``resolve_as`` names the other kind."""
        return self.native_bf16 if self.resolve_as is None else RESOLVE_KINDS[self.resolve_as]

    @property
    def onednn_bf16(self) -> bool:
        """Whether oneDNN can pack bfloat16 weights on this CPU (x86: AVX-512 BW/VL/DQ
        or AVX-NE-CONVERT; ARM: BF16)."""
        if self.is_x86:
            return any(self.has(*group) for group in _ONEDNN_BF16_X86)
        return self.is_arm and self.has("bf16")

    def allows(self, path: str) -> bool:
        """Whether a pseudo-feature (``onednn``, ``native``) is left visible."""
        return path not in self.hidden

    def compiler_arch(self) -> str:
        """``-march`` for the C kernels: ``native`` unless features are hidden, else
        the best generic level whose flags are all visible, so the build never uses
        an instruction the hidden machine would lack."""
        if not (self.hidden - set(PSEUDO_FEATURES)):
            return "native"
        if self.is_x86:
            return next((level for level, needs in _X86_LEVELS if self.has(*needs)), "x86-64")
        if self.is_arm:
            return "armv8.2-a" if self.has("asimdhp") else "armv8-a"
        return "native"

    def describe(self) -> str:
        """One line: the model and the flags that pick paths."""
        interesting = ("avx2", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "avx_ne_convert",
                       "fma", "asimd", "sve", "bf16")
        shown = [flag for flag in interesting if flag in self.flags]
        hidden = f", hiding {','.join(sorted(self.hidden))}" if self.hidden else ""
        resolve_as = f", defaults as {self.resolve_as}" if self.resolve_as else ""
        return (f"{self.model_name or self.arch} ({self.arch}; {' '.join(shown) or 'baseline'}"
                f"{hidden}{resolve_as})")


@functools.cache
def detect() -> CpuFeatures:
    """This process's CPU, with ``CADENCE_HIDE_CPU_FEATURES`` and ``CADENCE_RESOLVE_AS``
    applied (read once)."""
    return from_cpuinfo(_read_cpuinfo(), platform.machine(), hide=os.environ.get(HIDE_ENV, ""),
                        resolve_as=os.environ.get(RESOLVE_AS_ENV, "").strip().lower() or None)


def from_cpuinfo(cpuinfo: str, arch: str, *, hide: str | tuple[str, ...] = "",
                 resolve_as: str | None = None) -> CpuFeatures:
    """Parse ``/proc/cpuinfo`` text; ``hide`` is a comma-separated string or a tuple."""
    model_name, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model") and not model_name:
            model_name = value.strip()
        elif key in ("flags", "features"):
            flags.update(value.split())
    hidden = _hide_entries(hide)
    return CpuFeatures(arch, model_name, frozenset(_visible(flags, hidden)), hidden, resolve_as)


def with_hidden(features: CpuFeatures, *entries: str) -> CpuFeatures:
    """``features`` with more hidden (the suite runs lesser machines this way)."""
    hidden = features.hidden | _hide_entries(entries)
    return CpuFeatures(features.arch, features.model_name,
                       frozenset(_visible(features.flags, hidden)), hidden, features.resolve_as)


def resolved_as(features: CpuFeatures, kind: str | None) -> CpuFeatures:
    """``features`` resolving defaults as machine ``kind`` (None: as this CPU)."""
    return dataclasses.replace(features, resolve_as=kind)


def _hide_entries(hide: str | tuple[str, ...]) -> frozenset[str]:
    entries = hide.split(",") if isinstance(hide, str) else hide
    named = {entry.strip().lower() for entry in entries if entry.strip()}
    return frozenset(named.union(*(_IMPLIED.get(entry, ()) for entry in named)))


def _visible(flags: set[str] | frozenset[str], hidden: frozenset[str]) -> set[str]:
    prefixes = tuple(entry for entry in hidden if entry != "bf16")
    return {
        flag for flag in flags
        if not (prefixes and flag.startswith(prefixes))
        and not ("bf16" in hidden and flag in BF16_FLAGS)
    }


def _read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""  # not Linux: no flags known, every fast path is probed by trial alone
