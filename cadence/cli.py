"""Command line: ``cadence demo`` (scheduler demo) until the engine lands."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cadence")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run the scheduler benchmark on a small workload")
    args = parser.parse_args(argv)
    if args.command == "demo":
        bench = Path(__file__).resolve().parent.parent / "bench" / "sched_overhead.py"
        sys.argv = [str(bench), "--quick"]
        runpy.run_path(str(bench), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
