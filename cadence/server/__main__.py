"""``python -m cadence.server serve ...`` / ``python -m cadence.server bench serve ...``."""

import sys

from cadence.cli import run
from cadence.server.cli import build_parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
