"""CPU paged decode attention: the plain-torch path, the C++ portable loop and its vector version (AVX-512,
or AVX2 for a float32 cache: "kernel" below), for float32 and 16-bit caches.

    .venv/bin/python benchmarks/cpu_attention_bench.py [--out benchmarks/results/cpu_decode_attention.json]
        [--threads T] [--batches 1,32] [--contexts 256,1024,4096] [--dtypes float32,bfloat16] [--min-time 0.3]

The default model's heads (9 query heads over 3 KV heads of 64), blocks of 16 tokens scattered over the
cache at random as a long-running engine leaves them, every sequence at the same context length. As in
the model, each call goes to the next of several layers' caches (at least 512 MiB in all), so K and V
come from memory, not from a last-level cache that one small case would fit in. Times are medians of
single calls; GB/s counts the K and V bytes a call must read once; "x torch" is the speed-up over the torch path
of the same dtype, and "x f32 kernel" the speed-up over the float32 kernel on the same case (the
baseline a 16-bit cache has to beat to pay).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, for its packages

from bench_report import write_report  # noqa: E402
from kernels import cpu_decode_attention as kernel  # noqa: E402
from kernels.kv_cache import write_kv_cache_ref  # noqa: E402
from kernels.kv_layout import blocks_for_tokens, kv_cache_shape  # noqa: E402
from kernels.paged_attention import gathered_attention, plan_gather  # noqa: E402
from kernels.timing import time_calls  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16

POOL_BYTES = 512 * 2**20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def case(batch: int, context: int, dtype: torch.dtype, generator: torch.Generator):
    """q [batch, H, D], one cache per layer [2, blocks, BLOCK, KVH, D], block tables, seq_lens."""
    blocks_per_seq = blocks_for_tokens(context, BLOCK)
    num_blocks = batch * blocks_per_seq
    cache_bytes = 2 * num_blocks * BLOCK * KV_HEADS * HEAD_DIM * dtype.itemsize
    layers = max(2, -(-POOL_BYTES // cache_bytes))
    shape = kv_cache_shape(num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    caches = [torch.randn(shape, generator=generator).to(dtype) for _ in range(layers)]
    tables = torch.randperm(num_blocks, generator=generator).view(batch, blocks_per_seq)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=generator).to(dtype)
    return q, caches, tables, torch.full((batch,), context)


def next_layer(fn, caches: list[torch.Tensor]):
    """fn on the next layer's cache at each call, round the pool (a small case has thousands of layers)."""
    layers = itertools.cycle(caches)
    return lambda: fn(next(layers))


def measure(batch: int, context: int, dtype: torch.dtype, generator: torch.Generator, min_time: float) -> dict:
    """Times (ms) of the torch path, the portable loop and the kernel as it runs on one case; their errors
    against the float32 reference on the same values."""
    q, caches, tables, seq_lens = case(batch, context, dtype, generator)
    cache = caches[0]
    scale = HEAD_DIM**-0.5
    # The plain-torch path as the model runs it: the plan once per step, then per layer the cache write
    # and the gathered attention (in the cache's dtype: what a 16-bit model ran before the kernel took it).
    plan = plan_gather(torch.arange(batch + 1), seq_lens, tables, 1, context, BLOCK)
    slots = tables[:, -1] * BLOCK + (context - 1) % BLOCK
    k_new = cache[0, tables[:, -1], (context - 1) % BLOCK]  # rewrites the last token: same values
    v_new = cache[1, tables[:, -1], (context - 1) % BLOCK]

    def torch_path(c: torch.Tensor) -> torch.Tensor:
        write_kv_cache_ref(k_new, v_new, c, slots)
        return gathered_attention(q, c, plan, scale)

    calls = {
        "torch": torch_path,
        "portable": lambda c: kernel.paged_decode_attention(q, c, tables, seq_lens, scale, portable=True),
        "kernel": lambda c: kernel.paged_decode_attention(q, c, tables, seq_lens, scale),
    }
    reference = gathered_attention(q.float(), cache.float(), plan, scale)
    errors = {name: ((fn(cache).float() - reference).norm() / reference.norm()).item() for name, fn in calls.items()}
    times = {name: time_calls(next_layer(fn, caches), min_time=min_time).median_ms for name, fn in calls.items()}
    gb_per_s = 2 * batch * context * KV_HEADS * HEAD_DIM * dtype.itemsize / (times["kernel"] / 1e3) / 1e9
    return {"batch": batch, "context": context, "dtype": str(dtype).removeprefix("torch."), "times_ms": times,
            "rel_error_vs_float32": errors, "speedup_vs_torch": {name: times["torch"] / t for name, t in times.items()},
            "kernel_kv_gb_per_s": gb_per_s}


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/cpu_decode_attention.json")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--batches", default="1,32", help="comma-separated sequence counts")
    parser.add_argument("--contexts", default="256,1024,4096", help="comma-separated context lengths")
    parser.add_argument("--dtypes", default="float32,bfloat16", help=f"comma-separated, of {', '.join(DTYPES)}")
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds of timing per measurement")
    args = parser.parse_args()

    dtypes = [d.strip() for d in args.dtypes.split(",")]
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise SystemExit(f"unknown dtype {unknown[0]!r} (choose from {', '.join(DTYPES)})")
    if args.threads:
        torch.set_num_threads(args.threads)
    if kernel.load() is None:
        raise SystemExit("the CPU decode attention kernel could not be built here")
    generator = torch.Generator().manual_seed(0)
    rows = []
    header = (f"{'batch':>5} {'ctx':>5} {'dtype':>8} | {'torch ms':>9} {'portable ms':>11} {'kernel ms':>9} | "
              f"{'kernel x torch':>14} {'x f32 kernel':>12} {'kernel GB/s':>11}")
    vector = "AVX-512" if kernel.has_avx512() else "AVX2 (float32 caches)"
    print(f"threads {torch.get_num_threads()}, vector version: {vector}")
    print(header)
    print("-" * len(header))
    for batch in [int(v) for v in args.batches.split(",")]:
        for context in [int(v) for v in args.contexts.split(",")]:
            float32_kernel_ms = None
            for name in dtypes:
                row = measure(batch, context, DTYPES[name], generator, args.min_time)
                times = row["times_ms"]
                if name == "float32":
                    float32_kernel_ms = times["kernel"]
                if float32_kernel_ms is not None:
                    row["speedup_vs_float32_kernel"] = float32_kernel_ms / times["kernel"]
                rows.append(row)
                versus = f"{row['speedup_vs_float32_kernel']:>12.2f}" if float32_kernel_ms else f"{'':>12}"
                print(f"{batch:>5} {context:>5} {name:>8} | {times['torch']:>9.3f} {times['portable']:>11.3f} "
                      f"{times['kernel']:>9.3f} | {times['torch'] / times['kernel']:>14.2f} {versus} "
                      f"{row['kernel_kv_gb_per_s']:>11.1f}")
    write_report(args.out, rows, avx512=kernel.has_avx512())


if __name__ == "__main__":
    main()
