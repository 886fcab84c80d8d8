"""Perplexity of one model under several load-time quantizations and KV cache dtypes, in one run, against its
float32 self.

    .venv/bin/python benchmarks/perplexity.py [--model gemma-3-270m] [--quantization none,w8a8]
        [--kv-cache-dtype auto,bfloat16,float16] [--out benchmarks/results/perplexity.json]

The text is the built-in one (model/perplexity.py: Python's help topics, its first 2,048 tokens, which
SmoothQuant never calibrates on), scored in chunks of 256 tokens through the paged KV cache. `none` is the
checkpoint's weights in float32 (a GGUF file's dequantized); every other row is also given relative to it.
Each quantization runs with every KV cache dtype (`--kv-cache-dtype` of serve; auto: the activations').
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, for its packages

import model  # noqa: E402
from bench_report import write_report  # noqa: E402
from model.perplexity import PERPLEXITY_TOKENS, corpus_text, perplexity  # noqa: E402
from model.precision import parse_kv_cache_dtype  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a packaged model's name, a GGUF file or an HF directory")
    parser.add_argument("--quantization", default="none,w8a8", help="comma-separated; none comes first")
    parser.add_argument("--kv-cache-dtype", default="auto", help="comma-separated; auto comes first")
    parser.add_argument("--out", default="benchmarks/results/perplexity.json")
    args = parser.parse_args()
    schemes = ["none", *(q for q in args.quantization.split(",") if q != "none")]
    cache_dtypes = ["auto", *(d for d in args.kv_cache_dtype.split(",") if d != "auto")]
    rows = []
    for scheme in schemes:
        loaded = model.load(args.model, quantization=scheme)
        ids = loaded.tokenizer.encode(corpus_text())[:PERPLEXITY_TOKENS]
        for name in cache_dtypes:
            loaded.module.kv_cache_dtype = parse_kv_cache_dtype(name)
            start = time.perf_counter()
            value = perplexity(loaded.module, ids)
            rows.append({"quantization": scheme, "kv_cache_dtype": str(loaded.module.kv_cache_dtype).removeprefix("torch."),
                         "perplexity": value, "tokens": len(ids), "seconds": time.perf_counter() - start})
        del loaded
    base = rows[0]["perplexity"]
    print("| quantization | KV cache | perplexity | vs float32 |\n|---|---|---|---|")
    for row in rows:
        row["relative"] = row["perplexity"] / base - 1
        print(f"| {row['quantization']} | {row['kv_cache_dtype']} | {row['perplexity']:.3f} | "
              f"{100 * row['relative']:+.2f}% |")
    write_report(args.out, rows, model=args.model or "default")


if __name__ == "__main__":
    main()
