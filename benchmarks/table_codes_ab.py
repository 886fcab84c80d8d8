"""An IQ4 GGUF's decode step with its IQ4 blocks read as W4A8 table codes against requantized to 8 bits.

    .venv/bin/python benchmarks/table_codes_ab.py --model FILE [--steps 60] [--rounds 2]
        [--out benchmarks/results/table_codes_ab.json]

FILE holds IQ4_NL or IQ4_XS linears (`benchmarks/synthetic_gguf.py --preset iq4_xs`). Both readings are loaded in
this process, one after the other, alternating `--rounds` times; each times the median of `--steps` batch-1
decode steps (`Generator`, after a 64-token prompt) and counts the model's tensor bytes. The table gives the
median over rounds and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, for its packages

from bench_report import write_report

import model
from model import gguf_blocks
from model.generator import Generator

READINGS = {"table codes": True, "requantized 8-bit": False}


@torch.inference_mode()
def decode_step_ms(path: str, table_codes: bool, steps: int) -> tuple[float, int]:
    """The median decode step of the file read one way, and the model's tensor bytes."""
    wide_tables = gguf_blocks.wide_tables
    gguf_blocks.wide_tables = lambda: table_codes and wide_tables()  # the reader's choice, forced for the A/B
    try:
        module = model.load(path, quantization="w4a8").module
    finally:
        gguf_blocks.wide_tables = wide_tables
    held = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
    generator = Generator(module, 512)
    token = int(generator.step(list(range(1, 65)))[-1].argmax())
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        token = int(generator.step([token])[-1].argmax())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/table_codes_ab.json")
    args = parser.parse_args()
    if not gguf_blocks.wide_tables():
        sys.exit("this build's W4A8 tiles (AVX2) take no IQ4 tables: IQ4 is requantized either way")
    measured: dict[str, list[float]] = {label: [] for label in READINGS}
    held: dict[str, int] = {}
    for _ in range(args.rounds):
        for label, table_codes in READINGS.items():
            ms, held[label] = decode_step_ms(args.model, table_codes, args.steps)
            measured[label].append(ms)
            print(f"{label}: {ms:.2f} ms a decode step, {held[label] / 1e6:.0f} MB of tensors", flush=True)
    rows = [{"reading": label, "step_ms": statistics.median(times), "rounds_ms": times,
             "tensor_bytes": held[label]} for label, times in measured.items()]
    table, eight = rows
    print("\n| reading | decode step (median) | tensors |\n|---|---|---|")
    for row in rows:
        print(f"| {row['reading']} | {row['step_ms']:.2f} ms | {row['tensor_bytes'] / 1e6:.0f} MB |")
    print(f"| table / 8-bit | {table['step_ms'] / eight['step_ms']:.2f}x | "
          f"{table['tensor_bytes'] / eight['tensor_bytes']:.2f}x |")
    write_report(args.out, rows, model=args.model, steps=args.steps)


if __name__ == "__main__":
    main()
