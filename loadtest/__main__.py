"""`python -m loadtest ...`: the same as `ladder loadtest ...`."""

from __future__ import annotations

import argparse
import sys

from loadtest.cli import add_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["loadtest", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
