"""Every module's imports obey the layer table of ARCHITECTURE.md.

The table says which packages a package may import; the few exceptions are
listed with their reason. A new import that crosses a layer fails here, so
the rooms stay what ARCHITECTURE.md says they are. Imports inside functions
count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import cadence

PACKAGE_ROOT = Path(cadence.__file__).parent
# Leaf modules everyone may use: configuration, sampling parameters, the CPU probe,
# the optional compiled build's list and freshness check.
BASE = {"_lazy", "config", "config_cli", "sampling_params", "cpu_features", "compile"}
ALLOWED = {
    "core": BASE | {"core"},
    "kernels": BASE | {"kernels"},
    "models": BASE | {"models", "kernels"},
    "runner": BASE | {"runner", "core", "models", "kernels"},
    "structured": BASE | {"structured", "models"},
    "engine": BASE | {"engine", "core", "models", "runner", "structured"},
    "sim": BASE | {"sim", "core", "engine"},
    "server": BASE | {"server", "core", "engine", "models"},
}
# Base modules import only base modules.
ALLOWED.update({name: BASE for name in BASE})
EXCEPTIONS = {
    # (importing module, imported module): why it is allowed
    ("cadence.sim.cost_model", "cadence.models.config"):
        "model shapes for the cost model: ModelConfig is pure Python (no torch)",
    ("cadence.server.__main__", "cadence.cli"):
        "`python -m cadence.server` is an entry point that runs the command line",
}
TOP = {"cli", "__init__", "__main__"}  # the command line and the package's lazy names: anything


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def cadence_imports(path: Path) -> set[str]:
    """The cadence modules ``path`` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            # "from cadence import cpu_features" imports the module cadence.cpu_features.
            found.update(f"{node.module}.{alias.name}" for alias in node.names
                         if (PACKAGE_ROOT.parent / node.module.replace(".", "/") / f"{alias.name}.py").exists()
                         or (PACKAGE_ROOT.parent / node.module.replace(".", "/") / alias.name).is_dir())
    return {name for name in found if name == "cadence" or name.startswith("cadence.")}


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        module = module_name(path)
        layer = layer_of(module)
        if layer in TOP:
            continue
        for imported in sorted(cadence_imports(path)):
            if imported == "cadence":
                continue  # the package itself; its submodules are checked by name
            target = layer_of(imported)
            if target in ALLOWED[layer] or (module, imported) in EXCEPTIONS:
                continue
            found.append(f"{module} imports {imported} ({layer} may import {sorted(ALLOWED[layer])})")
    return found


def test_every_import_follows_the_layer_table():
    assert violations() == []


def test_every_package_has_a_row():
    packages = {p.name for p in PACKAGE_ROOT.iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in PACKAGE_ROOT.glob("*.py")}
    assert packages <= set(ALLOWED), packages - set(ALLOWED)
    assert modules <= set(ALLOWED) | TOP, modules - set(ALLOWED) - TOP


def test_the_check_sees_a_violation(tmp_path, monkeypatch):
    # A runner module importing the engine is caught.
    fake_root = tmp_path / "cadence"
    (fake_root / "runner").mkdir(parents=True)
    (fake_root / "__init__.py").write_text("")
    (fake_root / "runner" / "__init__.py").write_text("")
    (fake_root / "runner" / "bad.py").write_text("def f():\n    from cadence.engine.llm import LLM\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE_ROOT", fake_root)
    assert violations() == [
        "cadence.runner.bad imports cadence.engine.llm (runner may import "
        f"{sorted(ALLOWED['runner'])})"]


def test_exceptions_are_still_needed():
    """An exception that no longer matches any import is stale: remove it."""
    used = set()
    for path in PACKAGE_ROOT.rglob("*.py"):
        module = module_name(path)
        used.update((module, imported) for imported in cadence_imports(path))
    assert set(EXCEPTIONS) <= used, set(EXCEPTIONS) - used


def test_the_scheduler_calls_its_policy_through_the_declared_contract():
    """Every hook the scheduler calls is declared on ``SchedulingPolicy`` with
    its default: the scheduler never probes a policy (or anything) with
    getattr/hasattr."""
    source = (PACKAGE_ROOT / "core" / "sched" / "scheduler.py").read_text()
    probes = [node.func.id for node in ast.walk(ast.parse(source))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr")]
    assert probes == []


def test_the_engine_core_calls_its_runner_through_the_declared_protocol():
    source = (PACKAGE_ROOT / "engine" / "core.py").read_text()
    probes = [node.func.id for node in ast.walk(ast.parse(source))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr")]
    assert probes == []


# Issue 33: contracts are declared, never probed; device and CPU-feature
# choices live in runner/ and kernels/.

def getattr_probes(path: Path) -> list[int]:
    """Lines of ``path`` that call getattr or hasattr."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")]


def test_the_builder_reads_the_model_and_runner_through_declared_members():
    """The model's ``quantized_weights()`` and ``dequantized_at_load``, the runner's
    ``fused_decoder_note``: ``assemble_engine`` probes nothing."""
    assert getattr_probes(PACKAGE_ROOT / "engine" / "builder.py") == []


# Rooms that choose by device or CPU: the runner decides (cpu_paths, load_plan,
# device_setup), the kernels probe what they can run.
DEVICE_ROOMS = {"runner", "kernels"}
DEVICE_EXCEPTIONS: dict[str, str] = {
    # module: why it may read the device or the CPU itself (none today; the CPU
    # probe, cadence.cpu_features, reads /proc/cpuinfo and imports nothing checked here)
}


def device_choices(path: Path) -> list[str]:
    """What in ``path`` reads the device or the CPU: ``torch.cuda``, ``torch.backends``,
    a tensor's or device's ``.type``/``is_cuda``/``is_cpu``, or an import of the CPU probe."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            value = node.value
            if isinstance(value, ast.Name) and value.id == "torch" and node.attr in ("cuda", "backends"):
                found.append(f"torch.{node.attr} (line {node.lineno})")
            elif node.attr == "type" and (isinstance(value, ast.Name) and value.id == "device"
                                          or isinstance(value, ast.Attribute) and value.attr == "device"):
                found.append(f"device.type (line {node.lineno})")
            elif node.attr in ("is_cuda", "is_cpu"):
                found.append(f".{node.attr} (line {node.lineno})")
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch.cuda", "torch.backends") \
                or isinstance(node, ast.ImportFrom) and node.module == "torch" \
                and any(alias.name in ("cuda", "backends") for alias in node.names) \
                or isinstance(node, ast.Import) and any(alias.name.startswith(("torch.cuda", "torch.backends"))
                                                        for alias in node.names):
            found.append(f"imports torch's device module (line {node.lineno})")
    if "cadence.cpu_features" in cadence_imports(path):
        found.append("imports cadence.cpu_features")
    return found


def device_violations() -> dict[str, list[str]]:
    found = {}
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        module = module_name(path)
        if layer_of(module) in DEVICE_ROOMS or module in DEVICE_EXCEPTIONS:
            continue
        choices = device_choices(path)
        if choices:
            found[module] = choices
    return found


def test_device_and_cpu_choices_live_in_the_runner_and_the_kernels():
    assert device_violations() == {}


def test_the_device_check_sees_a_violation(tmp_path, monkeypatch):
    fake_root = tmp_path / "cadence"
    for room in ("engine", "models", "runner"):
        (fake_root / room).mkdir(parents=True)
        (fake_root / room / "__init__.py").write_text("")
    (fake_root / "__init__.py").write_text("")
    (fake_root / "cpu_features.py").write_text("")
    (fake_root / "engine" / "bad.py").write_text(
        "import torch\n\ndef f(x):\n    return x.device.type == 'cuda' or torch.cuda.is_available()\n")
    (fake_root / "models" / "bad.py").write_text("from cadence import cpu_features\n")
    (fake_root / "runner" / "fine.py").write_text(
        "import torch\nfrom cadence import cpu_features\n\ndef f(device):\n    return device.type\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE_ROOT", fake_root)
    assert device_violations() == {
        "cadence.engine.bad": ["device.type (line 4)", "torch.cuda (line 4)"],
        "cadence.models.bad": ["imports cadence.cpu_features"],
    }


def test_device_exceptions_are_still_needed():
    """An exception whose module no longer reads the device or the CPU is stale: remove it."""
    stale = [module for module in DEVICE_EXCEPTIONS
             if not device_choices(PACKAGE_ROOT.parent / (module.replace(".", "/") + ".py"))]
    assert stale == []


# The scheduler's state (issue 33): its queues, request map and id sets have
# one owner, ``Scheduler``; code outside ``core/sched`` asks its query methods.
SCHEDULER_STATE = {"running", "waiting", "requests", "lifecycle", "absorber", "finished_req_ids",
                   "sending_req_ids", "unsent_running", "forks", "finished_recving_kv_req_ids"}


def _reaches_scheduler_state(node: ast.AST) -> bool:
    """``x.scheduler.running``, ``scheduler.requests`` and the like."""
    if not (isinstance(node, ast.Attribute) and node.attr in SCHEDULER_STATE):
        return False
    owner = node.value
    return (isinstance(owner, ast.Attribute) and owner.attr == "scheduler") or \
        (isinstance(owner, ast.Name) and owner.id in ("scheduler", "sched"))


def test_nothing_outside_the_scheduler_package_reaches_into_its_state():
    found = []
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        if path.is_relative_to(PACKAGE_ROOT / "core" / "sched"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if _reaches_scheduler_state(node):
                found.append(f"{module_name(path)}:{node.lineno} .{node.attr}")
    assert found == []


def test_the_state_check_sees_a_reach():
    assert _reaches_scheduler_state(ast.parse("engine.core.scheduler.running").body[0].value)
    assert not _reaches_scheduler_state(ast.parse("scheduler.get_request_counts").body[0].value)


# Policies (issue 33): outside the scheduler's package, a policy is reached
# through the contract module ``cadence.core.sched.policy`` only.
POLICY_MODULES = {"cadence.core.sched.slo", "cadence.core.sched.fair", "cadence.core.sched.cache_aware"}
POLICY_IMPORT_EXCEPTIONS = {
    ("cadence.sim.cli", "cadence.core.sched.fair"):
        "the simulator weighs its fairness metric by fair's client weights, parsed by fair's parser",
}


def test_policies_are_reached_through_their_contract():
    found, used = [], set()
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        module = module_name(path)
        if module.startswith("cadence.core.sched"):
            continue
        for imported in cadence_imports(path) & POLICY_MODULES:
            used.add((module, imported))
            if (module, imported) not in POLICY_IMPORT_EXCEPTIONS:
                found.append(f"{module} imports {imported}")
    assert found == []
    assert set(POLICY_IMPORT_EXCEPTIONS) <= used, "a stale exception: remove it"
