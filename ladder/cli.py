"""The `ladder` command: one entry point, one subcommand per user-facing tool."""

from __future__ import annotations

import argparse
import sys

from engine.backends.manifest import ArtifactError
from ladder import bench, doctor, generate, pull, serve
from ladder import compile as compile_cli
from loadtest import cli as loadtest_cli
from model.errors import ModelLoadError
from parallel.errors import TensorParallelError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ladder", description="Serve, compile and load-test LLMs.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate.add_parser(commands)
    serve.add_parser(commands)
    bench.add_parser(commands)
    compile_cli.add_parser(commands)
    loadtest_cli.add_parser(commands)
    doctor.add_parser(commands)
    pull.add_parser(commands)
    for command in commands.choices.values():
        command.allow_abbrev = False  # a misspelt `--output` must not quietly become `--output-len`
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ArtifactError, ModelLoadError, TensorParallelError, ValueError, TimeoutError) as error:
        print(f"ladder {args.command}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
