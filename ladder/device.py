"""`--device cpu|cuda|auto`, shared by the commands that run a model."""

from __future__ import annotations

import argparse

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", choices=DEVICE_CHOICES,
                        help="where the model runs: auto (CUDA when present; an artifact's own device), cpu or "
                             "cuda (default auto)")
