"""The C++ multi-LoRA kernel (kernels/lora.py, ladder::lora_add) against the per-adapter loop reference, and
both against the float32 linear they sit on.

    .venv/bin/python benchmarks/lora_kernels.py [--out benchmarks/results/lora_kernels.json] [--t 1,8,32,256]
        [--rank 16] [--slots 8] [--threads T] [--min-time 0.3]

Shapes are SmolLM2-135M's projections (K -> N). Each case has `--slots` adapters (rank `--rank`) spread
over its T rows (row t takes slot t % slots), and one more case per shape has T=512 rows of one adapter
(a prefill). Times are medians over repeated calls with torch's default thread count, under inference
mode. `loop` is the reference (`lora_add_ref`: a boolean row mask and two matmuls per adapter present);
`dense` is one adapter's two matmuls over all T rows with no row selection (addmm(y, x @ A.T, B.T)), what
plain torch costs at best, exact only for the one-adapter case; `linear` is F.linear(x, W) of the same
K -> N in float32, the layer the adapters are added to. `loop/ours` is the speed-up over the reference,
`ours/linear` the kernel's cost relative to the base linear.
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
from kernels import lora  # noqa: E402
from kernels.timing import time_calls  # noqa: E402

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}  # name: (K, N)
PREFILL_ROWS = 512


def median_us(fn, min_time: float) -> float:
    return time_calls(fn, min_time=min_time).median_us


def cases(row_counts: list[int], num_slots: int) -> list[tuple[int, int]]:
    """(T, adapters in the batch): the decode batches, then one prefill of a single adapter."""
    return [(t, min(t, num_slots)) for t in row_counts] + [(PREFILL_ROWS, 1)]


@torch.inference_mode()  # as the engine runs: the op then dispatches straight to its C++ CPU kernel
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/lora_kernels.json")
    parser.add_argument("--t", default="1,8,32,256", help="comma-separated row counts of the multi-adapter cases")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--slots", type=int, default=8, help="adapter slots, spread over the rows")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds of timing per measurement")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    if lora.load() is None:
        raise SystemExit("the C++ CPU kernels could not be built here")
    build_s = time.perf_counter() - start
    torch.manual_seed(0)
    rows_out = []
    header = (f"{'proj':>7} {'K':>5} {'N':>5} {'T':>4} {'adapters':>8} | {'linear us':>9} {'loop us':>9} "
              f"{'dense us':>9} {'ours us':>9} | {'loop/ours':>9} {'ours/linear':>11} {'max rel err':>11}")
    print(f"threads {torch.get_num_threads()}, rank {args.rank}, {args.slots} slots, kernel load {build_s:.1f} s")
    print(header)
    print("-" * len(header))
    for name, (k, n) in SHAPES.items():
        weight = torch.randn(n, k) / k**0.5
        a = torch.randn(args.slots, args.rank, k) / k**0.5
        b = torch.randn(args.slots, args.rank, n) * 0.01
        for t, adapters in cases([int(v) for v in args.t.split(",")], args.slots):
            x = torch.randn(t, k)
            y = F.linear(x, weight)
            rows = torch.arange(t) % adapters
            times = {
                "linear": median_us(lambda: F.linear(x, weight), args.min_time),
                "loop": median_us(lambda: lora.lora_add_ref(y, x, a, b, rows), args.min_time),
                "dense": median_us(lambda: torch.addmm(y, x @ a[0].t(), b[0]), args.min_time),
                "ours": median_us(lambda: lora.lora_add(y, x, a, b, rows), args.min_time),
            }
            ref = lora.lora_add_ref(y, x, a, b, rows)
            err = ((lora.lora_add(y, x, a, b, rows) - ref).abs().max() / ref.abs().max()).item()
            speedup, relative = times["loop"] / times["ours"], times["ours"] / times["linear"]
            rows_out.append({"proj": name, "k": k, "n": n, "t": t, "adapters": adapters, "rank": args.rank,
                             "times_us": times, "loop_over_ours": speedup, "ours_over_linear": relative,
                             "max_rel_error": err})
            print(f"{name:>7} {k:>5} {n:>5} {t:>4} {adapters:>8} | {times['linear']:>9.1f} {times['loop']:>9.1f} "
                  f"{times['dense']:>9.1f} {times['ours']:>9.1f} | {speedup:>9.2f} {relative:>11.2f} {err:>11.1e}")
    write_report(args.out, rows_out, kernel_load_s=build_s, rank=args.rank, slots=args.slots)


if __name__ == "__main__":
    main()
