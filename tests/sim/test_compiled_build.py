"""The optional compiled build (cadence/compile.py), tested the other way round.

The suite runs on the pure-Python source. Here a copy of the package is
compiled with mypyc and, against that copy, the pinned simulations must give
the same digests to the bit and the scheduler's own tests (hypothesis
workloads, the KV-content oracle, the policies) must pass: mypyc checks every
annotation at run time, so a wrong one fails here, not in a user's build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypyc")

REPO = Path(__file__).resolve().parents[2]
IGNORED = shutil.ignore_patterns("__pycache__", "*.so", "compiled-manifest.json", ".hypothesis")


@pytest.fixture(scope="module")
def compiled_tree(tmp_path_factory) -> Path:
    """A copy of the package, compiled, with the tests that run against it."""
    root = tmp_path_factory.mktemp("compiled")
    shutil.copytree(REPO / "cadence", root / "cadence", ignore=IGNORED)
    shutil.copytree(REPO / "bench", root / "bench", ignore=IGNORED)  # (scripts some tests load)
    (root / "tests").mkdir()
    for part in ("__init__.py", "conftest.py", "core", "sim", "plugins"):
        source = REPO / "tests" / part
        if source.is_dir():
            shutil.copytree(source, root / "tests" / part, ignore=IGNORED)
        else:
            shutil.copy(source, root / "tests" / part)
    run(root, "-m", "cadence.compile", "build", timeout=900)
    return root


def run(root: Path, *args: str, timeout: float = 600) -> str:
    """``python *args`` in ``root``, where ``cadence`` is the compiled copy."""
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done.stdout


def test_every_listed_module_runs_compiled(compiled_tree):
    out = run(compiled_tree, "-c", "from cadence.compile import MODULES, compiled_modules, stale_modules\n"
              "import cadence.core.sched.scheduler as s\n"
              "assert compiled_modules() == list(MODULES), compiled_modules()\n"
              "assert s.__file__.endswith('.so') and not stale_modules()\n"
              "print(s.__file__)")
    assert out.strip().startswith(str(compiled_tree / "cadence"))


def test_pinned_simulations_and_the_scheduler_tests_pass_compiled(compiled_tree):
    """The simulator's tests (among them the pinned digests, the same to the bit)
    and the core's, on the compiled scheduler and simulator."""
    out = run(compiled_tree, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:warnings",
              "tests/sim", "tests/core", "--ignore=tests/sim/test_compiled_build.py", timeout=1200)
    assert " passed" in out and "failed" not in out


def test_a_build_older_than_its_sources_is_refused(compiled_tree, tmp_path):
    stale = tmp_path / "stale"
    shutil.copytree(compiled_tree / "cadence", stale / "cadence")
    step = stale / "cadence" / "core" / "sched" / "step.py"
    step.write_text(step.read_text() + "\n# edited after the build\n")
    env = {**os.environ, "PYTHONPATH": str(stale)}
    done = subprocess.run([sys.executable, "-c", "import cadence.core.sched.scheduler"], cwd=stale,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "older than its sources" in done.stderr and "cadence.core.sched.step" in done.stderr
