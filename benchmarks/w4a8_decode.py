"""W4A8 (a GGUF's own blocks) against W8A8 (int8 rows) on one model, in one process.

    .venv/bin/python benchmarks/w4a8_decode.py [--model FILE.gguf] [--threads T] [--rounds 9]
        [--out benchmarks/results/w4a8_decode.json]

--model: a GGUF file or packaged model's name (default: the embedded one). benchmarks/synthetic_gguf.py writes
files of larger shapes, in llama.cpp's Q4_K_M layout, for this.

Both quantized models are loaded side by side and timed in alternation (A, B, A, B, ...), so a load that
comes and goes on a shared machine hits both alike; medians over the rounds are reported with their ratio.

- Linear layers: every layer of one shape (the 30 q/k/v projections, ...; the LM head alone) run in
  sequence as a step runs them, on the models' own modules, at M = 1 and M = 32 rows.
- Eager decode steps: batch 1 and batch 32 (128-token prompts, then one token per sequence per step)
  through the small `Sequences` driver; the step is the model's whole forward and LM head.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import model
from model.sequences import Sequences

SHAPES = {"qkv_proj": "self_attn.qkv_proj", "o_proj": "self_attn.o_proj", "gate_up_proj": "mlp.gate_up_proj",
          "down_proj": "mlp.down_proj"}


def layers_of(module, name: str) -> list:
    if name == "lm_head":
        return [module.lm_head]
    return [layer.get_submodule(SHAPES[name]) for layer in module.layers]


def time_alternating(runs: dict, rounds: int, repeat: int) -> dict[str, float]:
    """Median seconds of one call of each run, the runs taken in turn every round."""
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():
        fn()  # warm-up
    for _ in range(rounds):
        for name, fn in runs.items():
            start = time.perf_counter()
            for _ in range(repeat):
                fn()
            samples[name].append((time.perf_counter() - start) / repeat)
    return {name: statistics.median(values) for name, values in samples.items()}


def decode_run(module, batch: int, steps: int):
    """A closure that decodes `steps` tokens for `batch` sequences from fresh 128-token prompts; returns
    seconds per step of its decode part."""
    prompts = [[(17 * s + 31 * i) % 20000 + 100 for i in range(128)] for s in range(batch)]

    def run() -> float:
        seqs = Sequences(module, batch, 128 + steps + 1)
        with torch.inference_mode():
            logits = seqs.step(prompts)
            start = time.perf_counter()
            for _ in range(steps):
                logits = seqs.step([[int(t)] for t in logits.argmax(-1)])
            return (time.perf_counter() - start) / steps
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF file or packaged model's name (default: the embedded)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", default="benchmarks/results/w4a8_decode.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    models = {q: model.load(args.model, quantization=q).module for q in ("w8a8", "w4a8")}
    rows = []
    with torch.inference_mode():
        for m in (1, 32):
            for name in [*SHAPES, "lm_head"]:
                layers = {q: layers_of(module, name) for q, module in models.items()}
                x = torch.randn(m, layers["w8a8"][0].in_features)
                runs = {q: (lambda ls=ls: [layer(x) for layer in ls]) for q, ls in layers.items()}
                med = time_alternating(runs, args.rounds, 5)
                rows.append({"what": f"{name} x{len(layers['w8a8'])}", "m": m,
                             "w8a8_us": med["w8a8"] * 1e6, "w4a8_us": med["w4a8"] * 1e6})
    for batch, steps in ((1, 32), (32, 8)):
        samples: dict[str, list[float]] = {q: [] for q in models}
        runs = {q: decode_run(module, batch, steps) for q, module in models.items()}
        for run in runs.values():
            run()
        for _ in range(max(3, args.rounds // 2)):
            for q, run in runs.items():
                samples[q].append(run())
        rows.append({"what": f"decode step, batch {batch}", "m": batch,
                     "w8a8_us": statistics.median(samples["w8a8"]) * 1e6,
                     "w4a8_us": statistics.median(samples["w4a8"]) * 1e6})
    print(f"model {args.model or 'default'}, threads {args.threads}, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (before the run)")
    print(f"{'what':<26} {'M':>3} {'w8a8 us':>10} {'w4a8 us':>10} {'w8a8 / w4a8':>12}")
    for row in rows:
        row["ratio"] = row["w8a8_us"] / row["w4a8_us"]
        print(f"{row['what']:<26} {row['m']:>3} {row['w8a8_us']:>10.1f} {row['w4a8_us']:>10.1f} {row['ratio']:>11.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "threads": args.threads, "loadavg_before": load, "rounds": args.rounds,
                               "torch": torch.__version__, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
