"""Decode steps over a float32, a bfloat16 and a float16 KV cache, alternated in one process: the C++ step's
part timer (attention includes the cache write), medians of the rounds.

    .venv/bin/python benchmarks/kv_cache_dtype_bench.py [--model M] [--quantization w4a8] [--batch 32]
        [--prompt-len 100] [--steps 12] [--rounds 3] [--out benchmarks/results/kv_cache_dtype.json]

Each round builds a fresh cache per dtype, prefills `batch` prompts of prompt-len to prompt-len + 19 random
tokens and times `steps` greedy decode steps. The model must run the C++ decoder step (a W4A8 or W8A8 model on
a CPU where the kernels build); `LADDER_CPU_CFLAGS=-mno-avx512f` times the AVX2 build on an AVX-512 host.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, for its packages

import torch  # noqa: E402

import model  # noqa: E402
from bench_report import write_report  # noqa: E402
from model.sequences import Sequences  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def one_round(module, prompts: list[list[int]], steps: int, dtype: torch.dtype) -> dict[str, float]:
    """Milliseconds per decode step: the whole step, the C++ layers and their attention."""
    module.kv_cache_dtype = dtype
    with torch.inference_mode():
        seqs = Sequences(module, len(prompts), max(map(len, prompts)) + steps + 1)
        tokens = seqs.step(prompts).argmax(-1).tolist()
        if module.cpu_step is None:
            raise SystemExit(f"the C++ decoder step does not run here: {module.cpu_step_reason}")
        module.cpu_step.set_profiling(True)
        seconds = []
        for _ in range(steps):
            start = time.perf_counter()
            tokens = seqs.step([[t] for t in tokens]).argmax(-1).tolist()
            seconds.append(time.perf_counter() - start)
        parts = module.cpu_step.take_profile()
        module.cpu_step.set_profiling(False)
    return {"step_ms": statistics.median(seconds) * 1e3, "layers_ms": sum(parts.values()) / steps * 1e3,
            "attention_ms": parts["attention"] / steps * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--quantization", default="w4a8")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/kv_cache_dtype.json")
    args = parser.parse_args()
    loaded = model.load(args.model, quantization=args.quantization)
    generator = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    prompts = [torch.randint(100, vocab, (args.prompt_len + i % 20,), generator=generator).tolist()
               for i in range(args.batch)]
    runs: dict[str, list[dict[str, float]]] = {str(d).removeprefix("torch."): [] for d in DTYPES}
    for _ in range(args.rounds):
        for dtype in DTYPES:
            runs[str(dtype).removeprefix("torch.")].append(one_round(loaded.module, prompts, args.steps, dtype))
    rows = []
    base = statistics.median(r["attention_ms"] for r in runs["float32"])
    print("| KV cache | step ms | layers ms | attention ms | attention vs float32 |\n|---|---|---|---|---|")
    for name, rounds in runs.items():
        row = {"kv_cache_dtype": name, "rounds": rounds,
               **{k: statistics.median(r[k] for r in rounds) for k in ("step_ms", "layers_ms", "attention_ms")}}
        rows.append(row)
        print(f"| {name} | {row['step_ms']:.2f} | {row['layers_ms']:.2f} | {row['attention_ms']:.2f} | "
              f"{row['attention_ms'] / base:.2f}x |")
    write_report(args.out, rows, model=args.model or "default", quantization=args.quantization, batch=args.batch,
                 prompt_len=args.prompt_len, steps=args.steps)


if __name__ == "__main__":
    main()
