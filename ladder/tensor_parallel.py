"""`--tensor-parallel-size N`, shared by serve, generate and bench."""

from __future__ import annotations

import argparse


def add_tensor_parallel_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="split the model over N ranks: this process and N-1 worker processes it starts "
                             "(gloo on a CPU, one GPU per rank with NCCL on CUDA); N may not exceed the model's "
                             "KV heads (default 1)")
