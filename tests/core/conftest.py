"""tests/core: pure-Python scheduler tests; helpers live in scheduler_sim.py and fakes.py."""

import os
import sys

# The helper modules beside this file are imported by name.
sys.path.insert(0, os.path.dirname(__file__))
