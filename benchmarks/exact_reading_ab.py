"""A GGUF's decode step with its blocks read as W4A8 reads them against those of `--types` requantized to 8 bits
(as W4A8 read IQ4_NL, IQ4_XS and Q3_K before it read them as table codes and 6-bit codes).

    .venv/bin/python benchmarks/exact_reading_ab.py --model FILE [--types IQ4_NL IQ4_XS Q3_K] [--steps 60]
        [--rounds 2] [--out benchmarks/results/exact_reading_ab.json]

FILE: e.g. `benchmarks/synthetic_gguf.py --preset iq4_xs` or `--preset q3_k`. Both readings are loaded in this
process, one after the other, alternating `--rounds` times; each times the median of `--steps` batch-1 decode
steps (`Generator`, after a 64-token prompt) and counts the model's tensor bytes. The table gives the median over
rounds and the ratio.
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
from model import gguf_checkpoint
from model.generator import Generator
from model.gguf_blocks import requantized

READINGS = ("as read", "requantized 8-bit")


@torch.inference_mode()
def decode_step_ms(path: str, requantize: tuple[str, ...], steps: int) -> tuple[float, int]:
    """The median decode step of the file with the blocks of the `requantize` types requantized to 8 bits, and
    the model's tensor bytes."""
    block_weight = gguf_checkpoint.block_weight

    def reading(raw, type_name: str, shape: tuple[int, int]):
        return requantized(raw, type_name, *shape) if type_name in requantize else block_weight(raw, type_name, shape)

    gguf_checkpoint.block_weight = reading  # the reader's choice, forced for the A/B
    try:
        module = model.load(path, quantization="w4a8").module
    finally:
        gguf_checkpoint.block_weight = block_weight
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
    parser.add_argument("--types", nargs="+", default=["IQ4_NL", "IQ4_XS", "Q3_K"])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/exact_reading_ab.json")
    args = parser.parse_args()
    measured: dict[str, list[float]] = {label: [] for label in READINGS}
    held: dict[str, int] = {}
    for _ in range(args.rounds):
        for label in READINGS:
            ms, held[label] = decode_step_ms(args.model, () if label == "as read" else tuple(args.types), args.steps)
            measured[label].append(ms)
            print(f"{label}: {ms:.2f} ms a decode step, {held[label] / 1e6:.0f} MB of tensors", flush=True)
    rows = [{"reading": label, "step_ms": statistics.median(times), "rounds_ms": times,
             "tensor_bytes": held[label]} for label, times in measured.items()]
    exact, eight = rows
    print("\n| reading | decode step (median) | tensors |\n|---|---|---|")
    for row in rows:
        print(f"| {row['reading']} | {row['step_ms']:.2f} ms | {row['tensor_bytes'] / 1e6:.0f} MB |")
    print(f"| as read / 8-bit | {exact['step_ms'] / eight['step_ms']:.2f}x | "
          f"{exact['tensor_bytes'] / eight['tensor_bytes']:.2f}x |")
    write_report(args.out, rows, model=args.model, steps=args.steps, types=args.types)


if __name__ == "__main__":
    main()
