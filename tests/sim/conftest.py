"""tests/sim: the simulator on the real scheduler. Pure Python (no model), fast.

Helpers live in tests/sim/sim_helpers.py.
"""
