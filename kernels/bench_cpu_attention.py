"""CPU paged decode attention: the plain-torch path, the C++ portable loop and its AVX-512 version.

    python -m kernels.bench_cpu_attention [--out benchmarks/results/cpu_decode_attention.json] [--threads T]
                                          [--batches 16,64] [--contexts 128,256,1024] [--min-time 0.3]

The default model's heads (9 query heads over 3 KV heads of 64), blocks of 16 tokens scattered over the
cache at random as a long-running engine leaves them, every sequence at the same context length. As in
the model, each call goes to the next of several layers' caches (at least 512 MiB in all), so K and V
come from memory, not from a last-level cache that one small case would fit in. Times are medians per
call; GB/s counts the K and V bytes a call must read once; ratios are over the torch path.
"""

from __future__ import annotations

import argparse

import torch

from kernels import cpu_decode_attention as kernel
from kernels.cpu_bench import median_us, write_report
from kernels.kv_cache import write_kv_cache_ref
from kernels.kv_layout import blocks_for_tokens, kv_cache_shape
from kernels.paged_attention import gathered_attention, plan_gather

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


POOL_BYTES = 512 * 2**20


def case(batch: int, context: int, generator: torch.Generator):
    """q [batch, H, D], one cache per layer [2, blocks, BLOCK, KVH, D], block tables, seq_lens."""
    blocks_per_seq = blocks_for_tokens(context, BLOCK)
    num_blocks = batch * blocks_per_seq
    cache_bytes = 2 * num_blocks * BLOCK * KV_HEADS * HEAD_DIM * 4
    layers = max(2, -(-POOL_BYTES // cache_bytes))
    shape = kv_cache_shape(num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    caches = [torch.randn(shape, generator=generator) for _ in range(layers)]
    tables = torch.randperm(num_blocks, generator=generator).view(batch, blocks_per_seq)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=generator)
    return q, caches, tables, torch.full((batch,), context)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/cpu_decode_attention.json")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--batches", default="16,64", help="comma-separated sequence counts")
    parser.add_argument("--contexts", default="128,256,1024", help="comma-separated context lengths")
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds of timing per measurement")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    if kernel.load() is None:
        raise SystemExit("the CPU decode attention kernel could not be built here")
    generator = torch.Generator().manual_seed(0)
    scale = HEAD_DIM**-0.5
    rows = []
    header = (f"{'batch':>5} {'ctx':>5} | {'torch ms':>9} {'portable ms':>11} {'avx512 ms':>9} | "
              f"{'portable x':>10} {'avx512 x':>8} {'avx512 GB/s':>11}")
    print(f"threads {torch.get_num_threads()}, AVX-512 version built: {kernel.has_avx512()}")
    print(header)
    print("-" * len(header))
    for batch in [int(v) for v in args.batches.split(",")]:
        for context in [int(v) for v in args.contexts.split(",")]:
            q, caches, tables, seq_lens = case(batch, context, generator)
            cache = caches[0]
            # The plain-torch path as the model runs it: the plan once per step, then per layer the
            # cache write and the gathered attention.
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
                "avx512": lambda c: kernel.paged_decode_attention(q, c, tables, seq_lens, scale),
            }
            reference = calls["torch"](cache)
            errors = {name: ((fn(cache) - reference).norm() / reference.norm()).item() for name, fn in calls.items()}
            times = {name: median_us(lambda: [fn(c) for c in caches], args.min_time) / 1e3 / len(caches)
                     for name, fn in calls.items()}
            gb_per_s = 2 * batch * context * KV_HEADS * HEAD_DIM * 4 / (times["avx512"] / 1e3) / 1e9
            rows.append({"batch": batch, "context": context, "times_ms": times, "rel_error_vs_torch": errors,
                         "speedup_vs_torch": {name: times["torch"] / t for name, t in times.items()},
                         "avx512_kv_gb_per_s": gb_per_s})
            print(f"{batch:>5} {context:>5} | {times['torch']:>9.2f} {times['portable']:>11.2f} "
                  f"{times['avx512']:>9.2f} | {times['torch'] / times['portable']:>10.2f} "
                  f"{times['torch'] / times['avx512']:>8.2f} {gb_per_s:>11.1f}")
    write_report(args.out, rows, avx512=kernel.has_avx512())


if __name__ == "__main__":
    main()
