"""The simulator runs the real scheduler and engine loop without loading torch."""

import subprocess
import sys

SCRIPT = r"""
import sys
sys.modules["torch"] = None  # any 'import torch' now raises ImportError
import cadence.sim.simulator, cadence.sim.cost_model, cadence.sim.workload, cadence.sim.cli
import cadence.sim.disaggregation
from cadence.engine import EngineCore
from cadence.models.config import ModelConfig
assert not any(m == "torch" or m.startswith("torch.") for m, v in sys.modules.items() if v is not None)
print(EngineCore.__name__, ModelConfig.__name__)
"""


def test_simulator_imports_without_torch():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "EngineCore ModelConfig"
