"""Q6_K read exactly (6-bit codes with their int8 sub-scales) against Q6_K requantized to 8 bits (how W4A8 read
it before), on one W4A8 model in one process, alternated: batch-1 and batch-32 decode steps and one prefill.

    .venv/bin/python benchmarks/q6_k_exact.py [--model FILE.gguf] [--rounds 5] [--prefill 512]
        [--out benchmarks/results/q6_k_exact.json]

--model: a GGUF holding Q6_K tensors (default /tmp/synth/llama1b-q4_k_m.gguf: `benchmarks/synthetic_gguf.py
--preset q4_k_m` writes it). The requantized model is loaded with the file's Q6_K tensors passed through
`model.gguf_blocks`'s requantizing reader (every other tensor as `ladder serve` reads it), so the two differ in
those layers only: the Q6_K LM head, the fused q/k/v whose v is Q6_K (6-bit with d and m, or 8-bit) and the
Q6_K ffn_down. Decode steps run through `Sequences` as benchmarks/w4a8_decode.py's do (128-token prompts);
the prefill is one prompt of --prefill tokens. Medians over the rounds, and the ratio exact / requantized.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Iterator

import numpy as np
import torch
from bench_report import write_report  # benchmarks/, this script's directory
from w4a8_decode import decode_run

import model
from model import gguf_blocks, gguf_checkpoint
from model.sequences import Sequences


@contextlib.contextmanager
def q6_k_requantized() -> Iterator[None]:
    """Within the block, GGUF checkpoints read Q6_K tensors by requantizing them to 8 bits."""
    original = gguf_checkpoint.GGUFCheckpoint._read_blocks

    def read(self, name, tensor):
        if tensor.tensor_type.name != "Q6_K":
            return original(self, name, tensor)
        k, n = int(tensor.shape[0]), int(np.prod(tensor.shape[1:]))
        return gguf_blocks.requantized(np.ascontiguousarray(tensor.data).reshape(n, -1), "Q6_K", n, k)

    gguf_checkpoint.GGUFCheckpoint._read_blocks = read
    try:
        yield
    finally:
        gguf_checkpoint.GGUFCheckpoint._read_blocks = original


def prefill_run(module, tokens: int):
    """A closure that prefills one prompt of `tokens` tokens on a fresh cache; returns its seconds."""
    prompt = [[(31 * i) % 20000 + 100 for i in range(tokens)]]

    def run() -> float:
        seqs = Sequences(module, 1, tokens + 1)
        with torch.inference_mode():
            start = time.perf_counter()
            seqs.step(prompt)
            return time.perf_counter() - start
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="/tmp/synth/llama1b-q4_k_m.gguf")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--out", default="benchmarks/results/q6_k_exact.json")
    args = parser.parse_args()
    load = os.getloadavg()
    exact = model.load(args.model, quantization="w4a8").module
    with q6_k_requantized():
        requantized = model.load(args.model, quantization="w4a8").module
    models = {"exact": exact, "requantized": requantized}
    layer = exact.layers[0]
    print(f"exact: LM head {exact.lm_head.bits}-bit, layer 0 qkv {layer.self_attn.qkv_proj.bits}-bit, "
          f"down {layer.mlp.down_proj.bits}-bit; requantized: LM head {requantized.lm_head.bits}-bit")
    cases = {"decode step, batch 1": lambda m: decode_run(m, 1, 32),
             "decode step, batch 32": lambda m: decode_run(m, 32, 8),
             f"prefill, {args.prefill} tokens": lambda m: prefill_run(m, args.prefill)}
    rows = []
    for what, make in cases.items():
        runs = {name: make(module) for name, module in models.items()}
        samples: dict[str, list[float]] = {name: [] for name in runs}
        for run in runs.values():
            run()  # warm-up
        for _ in range(args.rounds):
            for name, run in runs.items():
                samples[name].append(run())
        med = {name: statistics.median(values) * 1e3 for name, values in samples.items()}
        rows.append({"what": what, "exact_ms": med["exact"], "requantized_ms": med["requantized"],
                     "ratio": med["exact"] / med["requantized"]})
    print(f"model {args.model}, {args.rounds} rounds, load average {load[0]:.2f} (before the run)")
    print(f"{'what':<24} {'exact ms':>10} {'8-bit ms':>10} {'exact / 8-bit':>14}")
    for row in rows:
        print(f"{row['what']:<24} {row['exact_ms']:>10.2f} {row['requantized_ms']:>10.2f} {row['ratio']:>13.3f}x")
    write_report(args.out, rows, model=args.model, rounds=args.rounds, loadavg_before=load)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
