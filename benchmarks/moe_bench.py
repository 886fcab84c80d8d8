"""The grouped MoE feed-forward (kernels/moe.py `fused_moe`) against two per-expert loops, on the CPU.

    .venv/bin/python benchmarks/moe_bench.py [--out benchmarks/results/moe.json] [--tokens 1,8,32,128]
        [--hidden 1024] [--experts 64] [--top-k 8] [--intermediate 256] [--threads T] [--min-time 0.5]

Baselines, in the same run on the same weights and routing:
- `masked`: `fused_moe_ref`, every expert on every token, masked by the routing weight;
- `hf loop`: transformers' loop (Qwen3MoeExperts.forward), per expert hit a mask, a gather and an index_add_.
The last columns time `int8_moe`, the same grouping over weight-only int8 experts (`--quantization int8`),
and `w4a8_moe` over the same weights as 4-bit codes per 32-block (`--quantization w4a8` of a Q4_0 file): its
one C++ call (kernels/cpu_w4a8_experts.py) and its reference, the Python loop over experts, both on the
W4A8 kernel.
The default shape is a Qwen3-MoE layer shrunk to run in seconds on two cores (Qwen3-30B-A3B: H 2048,
E 128, top-8, I 768). Times are medians (kernels/timing.py) under inference mode, float32, torch's threads.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, for its packages

from bench_report import write_report  # noqa: E402
from kernels.int8_matmul import quantize_int8_ref  # noqa: E402
from kernels.cpu_w4a8_experts import w4a8_experts_ref  # noqa: E402
from kernels.cpu_w4a8_linear import pack  # noqa: E402
from kernels.moe import (  # noqa: E402
    fused_moe,
    fused_moe_ref,
    int8_moe,
    moe_loop_hf,
    pack_int8_experts,
    route,
    w4a8_moe,
)
from kernels.timing import time_calls  # noqa: E402


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/moe.json")
    parser.add_argument("--tokens", default="1,8,32,128", help="comma-separated token counts T")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--min-time", type=float, default=0.5, help="seconds of timing per measurement")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    h, e, k, inter = args.hidden, args.experts, args.top_k, args.intermediate
    torch.manual_seed(0)
    w13, w2 = torch.randn(e, 2 * inter, h) * 0.02, torch.randn(e, h, inter) * 0.02
    int8 = []  # packed weights and scales of w13, then of w2
    for w in (w13, w2):
        q, scale = quantize_int8_ref(w.reshape(-1, w.shape[-1]))
        int8 += [pack_int8_experts(q.view(w.shape)), scale.view(e, -1)]

    def int8_experts(x, logits, _w13, _w2, k):
        return int8_moe(x, logits, *int8, k)

    w4a8 = []  # codes and scales of w13, then of w2: Q4_0's rule, d = max |w| / 8 a 32-block, u = w / d + 8
    for w in (w13, w2):
        blocks = w.reshape(e, w.shape[1], -1, 32)
        d = (blocks.abs().amax(-1) / 8).half()
        codes = (blocks / d.float().unsqueeze(-1) + 8).round().clamp(0, 15).to(torch.uint8).reshape(w.shape)
        packed = [pack(codes[i], d[i], None, 4) for i in range(e)]
        w4a8 += [torch.stack([c for c, _ in packed]), torch.stack([s for _, s in packed]), 8]

    def w4a8_one_call(x, logits, _w13, _w2, k):
        return w4a8_moe(x, logits, *w4a8, k)

    def w4a8_loop(x, logits, _w13, _w2, k):
        weights, experts = route(logits, k, True)
        return w4a8_experts_ref(x, weights, experts, *w4a8, 0)

    print(f"threads {torch.get_num_threads()}, H {h}, E {e}, top-{k}, I {inter}, "
          f"expert weights {(w13.numel() + w2.numel()) * 4 / 2**20:.0f} MiB float32")
    header = (f"{'T':>4} {'experts hit':>11} | {'fused ms':>9} {'masked ms':>9} {'hf loop ms':>10} | "
              f"{'masked/fused':>12} {'hf/fused':>8} | {'int8 ms':>8} | {'w4a8 ms':>8} {'w4a8 loop ms':>12}")
    print(header)
    print("-" * len(header))
    rows = []
    for t in (int(x) for x in args.tokens.split(",")):
        x, logits = torch.randn(t, h), torch.randn(t, e)
        fused = fused_moe(x, logits, w13, w2, k)
        torch.testing.assert_close(fused, fused_moe_ref(x, logits, w13, w2, k), rtol=1e-4, atol=1e-5)
        hit = len(torch.topk(logits, k, dim=-1).indices.unique())
        times = {name: time_calls(lambda f=f, x=x, g=logits: f(x, g, w13, w2, k), min_time=args.min_time).median_s * 1e3
                 for name, f in (("fused", fused_moe), ("masked", fused_moe_ref), ("hf_loop", moe_loop_hf),
                                 ("int8", int8_experts), ("w4a8", w4a8_one_call), ("w4a8_loop", w4a8_loop))}
        row = {"tokens": t, "experts_hit": hit, **{f"{n}_ms": round(v, 3) for n, v in times.items()},
               "masked_over_fused": round(times["masked"] / times["fused"], 2),
               "hf_loop_over_fused": round(times["hf_loop"] / times["fused"], 2)}
        rows.append(row)
        print(f"{t:>4} {hit:>11} | {times['fused']:>9.2f} {times['masked']:>9.2f} {times['hf_loop']:>10.2f} | "
              f"{row['masked_over_fused']:>12.2f} {row['hf_loop_over_fused']:>8.2f} | {times['int8']:>8.2f} | "
              f"{times['w4a8']:>8.2f} {times['w4a8_loop']:>12.2f}")
    write_report(args.out, rows, shape={"hidden": h, "experts": e, "top_k": k, "intermediate": inter})


if __name__ == "__main__":
    main()
