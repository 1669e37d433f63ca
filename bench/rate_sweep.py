"""The loop the simulator's rate benchmarks share: each rate's runs, their
table, the simulator's own time, and every figure in one JSON at the end."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable


def sweep_rates(rates: str, run: Callable[[float], Any], table: Callable[[float, Any], str],
                workload: str, json_path: str | None) -> dict[float, Any]:
    """``run(rate)`` for each of the comma-separated ``rates``, printing ``table(rate, rows)``."""
    results = {}
    for rate in (float(r) for r in rates.split(",")):
        start = time.perf_counter()
        results[rate] = rows = run(rate)
        print(table(rate, rows))
        print(f"(simulated in {time.perf_counter() - start:.0f} s)\n", flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps({"workload": workload, "results": results}, indent=2))
    return results
