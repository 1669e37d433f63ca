"""The optional compiled build: the scheduler's hot loop and the simulator's, in C.

``make compiled`` (``python -m cadence.compile build``) runs mypyc over the
modules below and puts the extension modules beside their sources, where
Python imports them in place of the ``.py`` files. The source stays the one
source of truth, pure Python, and runs unchanged without the build (the
default: a fresh clone has none). ``python -m cadence.compile clean``
removes it; ``status`` says which modules run compiled.

A build records its sources' hashes (``compiled-manifest.json``); importing
``cadence.core`` refuses a build older than its sources, rather than run
code that is no longer in the tree.

The compiled modules are typed as written: mypyc checks each attribute and
argument against its annotation at run time, so a wrong annotation is a
``TypeError`` there (tests/sim/test_compiled_build.py runs the pinned
simulations and the core's tests both ways).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# (cadence.core imports this module for ``check_fresh``: the rest loads in the functions.)

PACKAGE_DIR = Path(__file__).resolve().parent
MANIFEST = PACKAGE_DIR / "compiled-manifest.json"
GROUP = "cadence.compiled_core"  # the shared library: cadence/compiled_core__mypyc*.so

# Per request and step: the request, the KV-cache manager and the scheduler; the
# simulator's runner, recorder and loop. Not here: msgspec structs (outputs.py,
# events.py), the engine (threads, protocols) and modules off the hot path.
MODULES = (
    "cadence.core.request",
    "cadence.core.kv_cache.block_pool",
    "cadence.core.kv_cache.groups",
    "cadence.core.kv_cache.hashing",
    "cadence.core.kv_cache.hybrid",
    "cadence.core.kv_cache.interface",
    "cadence.core.kv_cache.manager",
    "cadence.core.sched.absorb",
    "cadence.core.sched.admission",
    "cadence.core.sched.cache_aware",
    "cadence.core.sched.encoder",
    "cadence.core.sched.fair",
    "cadence.core.sched.interface",
    "cadence.core.sched.kv_connector",
    "cadence.core.sched.lifecycle",
    "cadence.core.sched.lora",
    "cadence.core.sched.output",
    "cadence.core.sched.parallel_sampling",
    "cadence.core.sched.policy",
    "cadence.core.sched.prefill_caps",
    "cadence.core.sched.scheduler",
    "cadence.core.sched.slo",
    "cadence.core.sched.spec_decode",
    "cadence.core.sched.step",
    "cadence.core.sched.step_faults",
    "cadence.core.sched.stop",
    "cadence.core.sched.structured_output",
    "cadence.core.sched.thinking",
    "cadence.sim.conversations",
    "cadence.sim.cost_model",
    "cadence.sim.metrics",
    "cadence.sim.runner",
    "cadence.sim.simulator",
)

MYPY_OPTIONS = ["--ignore-missing-imports", "--follow-imports=silent"]


def source_of(module: str) -> Path:
    return PACKAGE_DIR.parent.joinpath(*module.split(".")).with_suffix(".py")


def _source_hashes() -> dict[str, str]:
    import hashlib

    return {module: hashlib.sha256(source_of(module).read_bytes()).hexdigest() for module in MODULES}


def built_files() -> list[Path]:
    """The extension modules of a build (the shared library and one per module)."""
    found = sorted(PACKAGE_DIR.glob(GROUP.rsplit(".", 1)[1] + "__mypyc*.so"))
    for module in MODULES:
        path = source_of(module)
        found += sorted(path.parent.glob(path.stem + ".*.so"))
    return found


def stale_modules() -> list[str]:
    """Compiled modules whose source changed since the build (none without a build)."""
    if not MANIFEST.exists():
        return []
    import json

    recorded = json.loads(MANIFEST.read_text())["sources"]
    return [module for module, digest in _source_hashes().items() if recorded.get(module) != digest]


def check_fresh() -> None:
    """Refuse to import a compiled build older than its sources."""
    stale = stale_modules()
    if stale:
        raise ImportError(
            f"cadence's compiled build is older than its sources ({', '.join(stale[:3])}"
            f"{', ...' if len(stale) > 3 else ''}): rebuild it (make compiled) or remove it "
            "(python -m cadence.compile clean)")


def build(verbose: bool = False) -> list[Path]:
    """Compile ``MODULES`` in place; the files written."""
    import json
    import tempfile

    from mypyc.build import mypycify  # the build's own dependency (make compiled installs it)
    from setuptools import setup

    clean()
    root = PACKAGE_DIR.parent
    with tempfile.TemporaryDirectory(prefix="cadence-mypyc-") as temp:
        cwd = os.getcwd()
        os.chdir(root)  # mypyc names modules by their paths from here
        try:
            paths = [str(source_of(m).relative_to(root)) for m in MODULES]
            extensions = mypycify(MYPY_OPTIONS + paths, opt_level="3", group_name=GROUP,
                                  target_dir=os.path.join(temp, "c"), verbose=verbose)
            setup(name="cadence-compiled", ext_modules=extensions, script_name="cadence.compile",
                  script_args=["-q", "build_ext", "--inplace", "--build-temp", os.path.join(temp, "o"),
                               "--build-lib", os.path.join(temp, "lib")])
        finally:
            os.chdir(cwd)
    files = built_files()
    manifest = {"sources": _source_hashes(), "files": [str(f.relative_to(PACKAGE_DIR)) for f in files]}
    MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return files


def clean() -> list[Path]:
    """Remove a build (with what an older list of modules built); the files removed."""
    removed = set(built_files())
    if MANIFEST.exists():
        import json

        removed.update(PACKAGE_DIR / name for name in json.loads(MANIFEST.read_text()).get("files", []))
    removed = {path for path in removed if path.exists()}
    for path in removed:
        path.unlink()
    if MANIFEST.exists():
        MANIFEST.unlink()
        removed.add(MANIFEST)
    return sorted(removed)


def compiled_modules() -> list[str]:
    """The modules of ``MODULES`` that Python loads from an extension module."""
    import importlib.util

    compiled = []
    for module in MODULES:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.origin is not None and spec.origin.endswith(".so"):
            compiled.append(module)
    return compiled


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m cadence.compile", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("build", "clean", "status"))
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.action == "build":
        files = build(args.verbose)
        print(f"compiled {len(MODULES)} modules ({len(files)} extension files beside their sources)")
    elif args.action == "clean":
        print(f"removed {len(clean())} files")
    else:
        stale = stale_modules()
        compiled = compiled_modules()
        print(f"{len(compiled)} of {len(MODULES)} modules compiled" + (f"; stale: {stale}" if stale else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
