"""The `ladder` command line's parsing."""

from __future__ import annotations

import pytest

from ladder.cli import build_parser


def test_options_are_not_abbreviated(capsys):
    """`--output` is not `--output-len`: a prefix of an option is an error, not that option."""
    assert build_parser().parse_args(["bench", "--output-len", "8"]).output_len == 8
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", "--output", "run.json"])
    assert exit_info.value.code == 2 and "--output" in capsys.readouterr().err
