"""One eager decode step of the default model: bfloat16 on the C++ decode attention against bfloat16 on the
gather path (what it ran before the kernel took 16-bit caches) and float32 on the kernel, in one run.

    .venv/bin/python benchmarks/bf16_decode_step.py [--batches 1,32] [--contexts 128,1024] [--steps 7]
                                                    [--threads T] [--out benchmarks/results/bf16_decode_step.json]

Each of `batch` sequences already holds `context` tokens (the cache's values do not change the work) and
decodes one token per step through the whole model (embedding, 30 layers, LM head). The three variants
take turns step by step, so a burst of load on this shared machine hits all of them alike; times are
medians over the steps after two warm-up steps. KV MiB is the cache the batch occupies at that context.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench_report import write_report  # benchmarks/, this script's directory
import model
from model.attention import CpuPagedAttention, TorchPagedAttention, install
from model.sequences import Sequences

VARIANTS = (("float32", "kernel"), ("bfloat16", "gather"), ("bfloat16", "kernel"))


def use_attention(module: torch.nn.Module, kind: str) -> None:
    """Every layer on the C++ decode kernel ("kernel") or on the plain-torch gather path ("gather")."""
    cls = CpuPagedAttention if kind == "kernel" else TorchPagedAttention
    install(module, cls(module.block_size, module.config.sliding_window))


def timed_step(sequences: Sequences, batch: int) -> float:
    start = time.perf_counter()
    sequences.step([[1]] * batch)
    return time.perf_counter() - start


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--contexts", default="128,1024")
    parser.add_argument("--steps", type=int, default=7, help="timed steps per variant (after 2 warm-up steps)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--out", default="benchmarks/results/bf16_decode_step.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    modules = {dtype: model.load(None, dtype=dtype).module for dtype in ("float32", "bfloat16")}
    rows = []
    header = (f"{'batch':>5} {'ctx':>5} {'KV MiB f32':>10} | {'f32 kernel ms':>13} {'bf16 gather ms':>14} "
              f"{'bf16 kernel ms':>14} | {'bf16 kernel/gather':>18} {'bf16 kernel/f32':>15}")
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")
    print(header)
    print("-" * len(header))
    for batch in [int(v) for v in args.batches.split(",")]:
        for context in [int(v) for v in args.contexts.split(",")]:
            runs = {}
            for dtype, kind in VARIANTS:
                sequences = Sequences(modules[dtype], batch, context + args.steps + 2)
                sequences.lengths = [context - 1] * batch  # the first step's token is the context-th
                runs[dtype, kind] = sequences
            times: dict[tuple[str, str], list[float]] = {v: [] for v in VARIANTS}
            for step in range(args.steps + 2):
                for dtype, kind in VARIANTS:
                    use_attention(modules[dtype], kind)
                    elapsed = timed_step(runs[dtype, kind], batch)
                    if step >= 2:
                        times[dtype, kind].append(elapsed)
            medians = {f"{dtype} {kind}": statistics.median(t) * 1e3 for (dtype, kind), t in times.items()}
            kv_mib = sum(c.numel() * c.element_size() for c in runs["float32", "kernel"].kv_caches) / 2**20
            f32, gather, ours = medians["float32 kernel"], medians["bfloat16 gather"], medians["bfloat16 kernel"]
            rows.append({"batch": batch, "context": context, "median_step_ms": medians,
                         "float32_kv_cache_mib": kv_mib, "bfloat16_kernel_speedup_vs_gather": gather / ours,
                         "bfloat16_kernel_speedup_vs_float32_kernel": f32 / ours,
                         "load_average_1min": os.getloadavg()[0]})
            print(f"{batch:>5} {context:>5} {kv_mib:>10.0f} | {f32:>13.1f} {gather:>14.1f} {ours:>14.1f} | "
                  f"{gather / ours:>18.2f} {f32 / ours:>15.2f}")
            del runs
    for module in modules.values():
        use_attention(module, "kernel")
    write_report(args.out, rows, steps=args.steps)


if __name__ == "__main__":
    main()
