"""CPU weight-only INT8 linear against float32 / bfloat16 F.linear and torch's _weight_int8pack_mm.

    .venv/bin/python benchmarks/cpu_int8_bench.py [--out benchmarks/results/cpu_int8_linear.json] [--m 1,8,32]
        [--threads T] [--min-time 0.3]

Shapes are SmolLM2-135M's linears (N, K); times are medians over repeated calls with torch's default
thread count, under inference mode. Ratios are each time over the float32 F.linear time (below 1 is faster).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, for its packages

from bench_report import write_report  # noqa: E402
from kernels import cpu_int8_linear as kernel  # noqa: E402
from kernels.int8_matmul import quantize_int8_ref  # noqa: E402
from kernels.timing import time_calls  # noqa: E402


def median_us(fn, min_time: float) -> float:
    return time_calls(fn, min_time=min_time).median_us


SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]  # (N, K)


@torch.inference_mode()  # as the engine runs: the op then dispatches straight to its C++ CPU kernel
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/cpu_int8_linear.json")
    parser.add_argument("--m", default="1,8,32", help="comma-separated row counts")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds of timing per measurement")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    if kernel.load() is None:
        raise SystemExit("the CPU int8 linear kernel could not be built here")
    build_s = time.perf_counter() - start
    torch.manual_seed(0)
    rows = []
    header = (f"{'N':>6} {'K':>5} {'M':>3} | {'fp32 us':>9} {'bf16 us':>9} {'int8pack us':>11} {'ours us':>9} | "
              f"{'bf16/fp32':>9} {'i8pack/fp32':>11} {'ours/fp32':>9}")
    print(f"threads {torch.get_num_threads()}, kernel load {build_s:.1f} s")
    print(header)
    print("-" * len(header))
    for n, k in SHAPES:
        weight = torch.randn(n, k) * 0.05
        q, scale = quantize_int8_ref(weight)
        packed = kernel.pack(q)
        w32 = q.float() * scale[:, None]
        w16 = w32.bfloat16()
        for m in [int(v) for v in args.m.split(",")]:
            x = torch.randn(m, k)
            x16 = x.bfloat16()
            times = {
                "fp32": median_us(lambda: F.linear(x, w32), args.min_time),
                "bf16": median_us(lambda: F.linear(x16, w16), args.min_time),
                "int8pack": median_us(lambda: torch.ops.aten._weight_int8pack_mm(x, q, scale), args.min_time),
                "ours": median_us(lambda: kernel.int8_linear(x, packed, scale, None, n), args.min_time),
            }
            err = ((kernel.int8_linear(x, packed, scale, None, n) - F.linear(x, w32)).abs().max()
                   / F.linear(x, w32).abs().max()).item()
            ratios = {name: t / times["fp32"] for name, t in times.items()}
            rows.append({"n": n, "k": k, "m": m, "times_us": times, "ratio_vs_fp32": ratios, "max_rel_error": err})
            print(f"{n:>6} {k:>5} {m:>3} | {times['fp32']:>9.1f} {times['bf16']:>9.1f} {times['int8pack']:>11.1f} "
                  f"{times['ours']:>9.1f} | {ratios['bf16']:>9.2f} {ratios['int8pack']:>11.2f} {ratios['ours']:>9.2f}")
    write_report(args.out, rows, kernel_load_s=build_s)


if __name__ == "__main__":
    main()
