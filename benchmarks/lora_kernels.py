"""The C++ multi-LoRA kernel (kernels/lora.py, ladder::lora_add) against the per-adapter loop reference, and
both against the float32 linear they sit on.

    .venv/bin/python benchmarks/lora_kernels.py [--out benchmarks/results/lora_kernels.json] [--t 1,8,32,256]
        [--rank 16] [--slots 8] [--threads T] [--min-time 0.3]
    .venv/bin/python benchmarks/lora_kernels.py --splits [--out benchmarks/results/lora_kernels_splits.json]
        [--t 1,8,32,256] [--slots 8] [--layers 30] [--threads T] [--min-time 0.3]

Shapes are SmolLM2-135M's projections (K -> N). Each case has `--slots` adapters (rank `--rank`) spread
over its T rows (row t takes slot t % slots), and one more case per shape has T=512 rows of one adapter
(a prefill). Times are medians over repeated calls with torch's default thread count, under inference
mode. `loop` is the reference (`lora_add_ref`: a boolean row mask and two matmuls per adapter present);
`dense` is one adapter's two matmuls over all T rows with no row selection (addmm(y, x @ A.T, B.T)), what
plain torch costs at best, exact only for the one-adapter case; `linear` is F.linear(x, W) of the same
K -> N in float32, the layer the adapters are added to. `loop/ours` is the speed-up over the reference,
`ours/linear` the kernel's cost relative to the base linear.

`--splits`: the fused projections as model/lora_slots.py stacks them, b block-diagonal (part p's rank rows
non-zero only in part p's columns): qkv (P = 3 parts of rank 16, R = 48, N = 960 = 576 + 192 + 192) and
gate_up (P = 2 parts of rank 16, R = 32, N = 3072 = 1536 + 1536), `lora_add` without splits (reading the
whole b) against with splits (b read inside the parts alone). `cached`: one copy of the weights, called
again and again (they stay in the CPU's caches); `stream`: `--layers` copies, one per layer, called in turn
as a decode step runs the layers (the weights come from DRAM when the copies outgrow the last-level
cache); the time is per call. `MB/call` is the weight bytes a call reads (a and b of the adapters present).
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
SPLIT_SHAPES = {"qkv": (576, 16, [0, 576, 768, 960]), "gate_up": (576, 16, [0, 1536, 3072])}  # (K, rank/part, splits)


def median_us(fn, min_time: float) -> float:
    return time_calls(fn, min_time=min_time).median_us


def cases(row_counts: list[int], num_slots: int) -> list[tuple[int, int]]:
    """(T, adapters in the batch): the decode batches, then one prefill of a single adapter."""
    return [(t, min(t, num_slots)) for t in row_counts] + [(PREFILL_ROWS, 1)]


def block_diagonal_b(slots: int, rank: int, splits: list[int]) -> torch.Tensor:
    """[slots, P * rank, N]: part p's rank rows random in part p's columns, zeros elsewhere."""
    parts = len(splits) - 1
    b = torch.zeros(slots, parts * rank, splits[-1])
    for p in range(parts):
        width = splits[p + 1] - splits[p]
        b[:, p * rank:(p + 1) * rank, splits[p]:splits[p + 1]] = torch.randn(slots, rank, width) * 0.01
    return b


def run_splits(args: argparse.Namespace, build_s: float) -> None:
    """The --splits table (module docstring)."""
    rows_out = []
    header = (f"{'proj':>7} {'P':>2} {'R':>3} {'N':>5} {'T':>4} {'adapters':>8} {'mode':>7} | {'MB/call':>13} | "
              f"{'no splits us':>12} {'splits us':>9} | {'speed-up':>8} {'max rel err':>11}")
    print(f"threads {torch.get_num_threads()}, {args.slots} slots, {args.layers} layers streamed, "
          f"kernel load {build_s:.1f} s")
    print(header)
    print("-" * len(header))
    for name, (k, part_rank, splits) in SPLIT_SHAPES.items():
        parts, n = len(splits) - 1, splits[-1]
        rank = parts * part_rank
        layers = [(torch.randn(args.slots, rank, k) / k**0.5, block_diagonal_b(args.slots, part_rank, splits))
                  for _ in range(args.layers)]
        for t, adapters in cases([int(v) for v in args.t.split(",")], args.slots)[:-1]:
            x, y = torch.randn(t, k), torch.randn(t, n)
            rows = torch.arange(t) % adapters
            a, b = layers[0]
            ref = lora.lora_add_ref(y, x, a, b, rows)
            err = ((lora.lora_add(y, x, a, b, rows, splits) - ref).abs().max() / ref.abs().max()).item()
            bytes_full = adapters * rank * (k + n) * 4
            bytes_split = adapters * (rank * k + part_rank * n) * 4  # each part's rank rows in its own columns
            for mode in ("cached", "stream"):
                def call(chosen, mode=mode):
                    if mode == "cached":
                        return lambda: lora.lora_add(y, x, a, b, rows, chosen)

                    def step():
                        for la, lb in layers:
                            lora.lora_add(y, x, la, lb, rows, chosen)
                    return step
                calls = 1 if mode == "cached" else len(layers)
                full = median_us(call(None), args.min_time) / calls
                split = median_us(call(splits), args.min_time) / calls
                rows_out.append({"proj": name, "parts": parts, "rank": rank, "k": k, "n": n, "splits": splits, "t": t,
                                 "adapters": adapters, "mode": mode, "bytes_no_splits": bytes_full,
                                 "bytes_splits": bytes_split, "no_splits_us": full, "splits_us": split,
                                 "speedup": full / split, "max_rel_error": err})
                mb = f"{bytes_full / 1e6:.2f}->{bytes_split / 1e6:.2f}"
                print(f"{name:>7} {parts:>2} {rank:>3} {n:>5} {t:>4} {adapters:>8} {mode:>7} | {mb:>13} | "
                      f"{full:>12.1f} {split:>9.1f} | {full / split:>8.2f} {err:>11.1e}")
    write_report(args.out, rows_out, kernel_load_s=build_s, slots=args.slots, layers=args.layers)


@torch.inference_mode()  # as the engine runs: the op then dispatches straight to its C++ CPU kernel
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="default benchmarks/results/lora_kernels[_splits].json")
    parser.add_argument("--t", default="1,8,32,256", help="comma-separated row counts of the multi-adapter cases")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--slots", type=int, default=8, help="adapter slots, spread over the rows")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds of timing per measurement")
    parser.add_argument("--splits", action="store_true", help="the fused projections with and without splits")
    parser.add_argument("--layers", type=int, default=30, help="--splits: weight copies streamed, one per layer")
    args = parser.parse_args()
    if args.out is None:
        args.out = f"benchmarks/results/lora_kernels{'_splits' if args.splits else ''}.json"

    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    if lora.load() is None:
        raise SystemExit("the C++ CPU kernels could not be built here")
    build_s = time.perf_counter() - start
    torch.manual_seed(0)
    if args.splits:
        return run_splits(args, build_s)
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
