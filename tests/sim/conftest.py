"""tests/sim: the simulator on the real scheduler. Pure Python (no model), fast.

Helpers live in sim_helpers.py beside this file, imported by name.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
