"""`--tensor-parallel-size N` and `--tensor-parallel-attention`, shared by serve, generate and bench."""

from __future__ import annotations

import argparse

from parallel.layout import ATTENTION_SPLITS


def add_tensor_parallel_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="split the model over N ranks: this process and N-1 worker processes it starts "
                             "(gloo on a CPU, one GPU per rank with NCCL on CUDA); split by heads, N may not exceed "
                             "the model's KV heads (default 1)")
    parser.add_argument("--tensor-parallel-attention", choices=("auto", *ATTENTION_SPLITS), default="auto",
                        help="how the ranks split attention: by KV heads (each rank its heads of every sequence), "
                             "or by sequences (each rank every head of its own sequences, and its own part of "
                             "the KV cache; no limit from the KV heads); auto: by sequences for many sequences "
                             "on a CPU (serve, bench), by heads on CUDA and for one sequence (generate)")
