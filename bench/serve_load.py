#!/usr/bin/env python3
"""Load benchmark of a running server (same as ``cadence bench serve``).

    python bench/serve_load.py --rate 0.5 --num-prompts 64 [--base-url http://127.0.0.1:8000]

The logic lives in ``cadence.server.bench`` so the installed CLI can run it.
"""

import sys

from cadence.server.bench import main

if __name__ == "__main__":
    sys.exit(main())
