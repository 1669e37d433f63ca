"""cadence.core: the scheduler, KV-cache manager and request model. Pure Python, no torch."""

from cadence.compile import check_fresh as _check_fresh

_check_fresh()  # a compiled build (optional: cadence/compile.py) must match these sources
