"""tests/core: pure-Python scheduler tests; helpers live in tests/core/fakes.py and
tests/core/scheduler_sim.py (both on cadence.core.testing)."""
