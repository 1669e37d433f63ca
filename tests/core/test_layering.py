"""cadence.core must import (and work) with torch unavailable."""

import subprocess
import sys

SCRIPT = r"""
import sys
sys.modules["torch"] = None  # any 'import torch' now raises ImportError
import cadence.core, cadence.core.request, cadence.core.outputs, cadence.core.kv_cache
import cadence.core.sched.scheduler, cadence.core.sched.output, cadence.core.sched.interface
import cadence.config, cadence.sampling_params
from cadence.core.sched.scheduler import Scheduler
from cadence.config import SchedulerConfig, CacheConfig
from cadence.core.request import Request
from cadence.sampling_params import SamplingParams
s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64),
              CacheConfig(block_size=4, num_gpu_blocks=8))
s.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=1)))
print(s.schedule().num_scheduled_tokens)
assert not any(m == "torch" or m.startswith("torch.") for m, v in sys.modules.items() if v is not None)
"""


def test_core_imports_and_schedules_without_torch():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "{'a': 3}"
