#!/usr/bin/env python3
"""The KV-content oracle at length: the property of
``tests/core/test_kv_oracle.py`` (every step reads the KV its tokens wrote,
over random workloads that mix every scheduling feature) over many more
examples than ``make test`` runs (each workload also run as prefill/decode
disaggregation: a producer and a consumer scheduler), with totals of what the examples exercised.

    python bench/kv_oracle.py                   # 20,000 examples
    python bench/kv_oracle.py --examples 2000 --seed 1
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hypothesis import HealthCheck, given, note, seed, settings  # noqa: E402

from tests.core.kv_oracle import (  # noqa: E402
    expected_streams, pd_workload, run_pd_workload, run_workload, workloads,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    totals: collections.Counter = collections.Counter()
    features: collections.Counter = collections.Counter()

    @settings(max_examples=args.examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(workloads())
    def check(w):
        note(repr(w))
        run = run_workload(w)
        expected_streams(w, run)
        totals["examples"] += 1
        totals["steps"] += run.num_steps
        totals["positions read and checked"] += run.num_reads_checked
        totals["preemptions"] += run.num_preemptions
        totals["swapped preemptions"] += run.num_swaps
        totals["failed loads"] += run.num_failed_loads
        totals["aborts"] += len(run.aborted)
        pd = pd_workload(w)
        note(f"P/D: {pd!r}")
        pd_run = run_pd_workload(pd)
        expected_streams(pd, pd_run)
        totals["P/D steps (producer and consumer)"] += pd_run.num_steps
        totals["P/D positions read and checked"] += pd_run.num_reads_checked
        totals["P/D failed loads"] += pd_run.num_failed_loads
        features[f"policy {w.scheduler['policy']}"] += 1
        for name, on in (("prefix caching", w.scheduler["enable_prefix_caching"]),
                         ("chunked prefill off", not w.scheduler["enable_chunked_prefill"]),
                         ("partial-prefill caps", "max_num_partial_prefills" in w.scheduler),
                         ("async scheduling", w.async_scheduling),
                         ("speculative tokens", w.num_spec > 0),
                         ("host tier", w.tier_slots > 0),
                         ("grammars", w.structured),
                         ("n > 1", any(r["n"] > 1 for r in w.requests))):
            features[name] += bool(on)

    check = seed(args.seed)(check)
    start = time.perf_counter()
    check()
    seconds = time.perf_counter() - start
    print(f"kv-oracle: {totals['examples']:,} examples in {seconds:.0f} s "
          f"({platform.python_implementation()} {platform.python_version()}, {platform.processor() or platform.machine()})")
    for name, value in totals.items():
        print(f"  {name}: {value:,}")
    print("  workloads with:", ", ".join(f"{k} {v:,}" for k, v in sorted(features.items())))
    print("  found: nothing (every example passed)")


if __name__ == "__main__":
    main()
