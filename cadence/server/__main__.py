"""``python -m cadence.server serve ...`` / ``python -m cadence.server bench serve ...``."""

import sys

from cadence.server.cli import build_parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        print(f"cadence: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
