"""One decode step when other processes share the cores: the kernels' loops with their stall guard against
plain OpenMP loops, and the decoder's layers as one C++ call against the eager layers, in one run.

For each setting of the guard (kernels/csrc/parallel.h; `LADDER_CPU_STALL_GUARD=0` turns it off, which is
what the kernels ran before) and each number of competitors (busy processes, one spinning Python loop
each), a child process loads the model, starts the competitors, and times batch-1 decode steps
(`Sequences.step`: the layers, the LM head, the step's inputs; no sampling) with the C++ step and with the
eager layers, alternated. It prints a table of medians (and 90th percentiles) and writes JSON.

    .venv/bin/python benchmarks/shared_cores.py [--model gemma-3-270m --quantization w8a8] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def spin() -> None:
    while True:
        pass


def child(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch

    from model.loader import load
    from model.sequences import Sequences

    module = load(args.model, quantization=args.quantization).module
    seqs = Sequences(module, 1, args.context + args.steps * 2 + 8)
    seqs.step([list(range(1000, 1000 + args.context))])
    competitors = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.competitors)]
    for p in competitors:
        p.start()
    time.sleep(0.5)
    times: dict[str, list[float]] = {"step": [], "eager": []}
    try:
        for i in range(2 * args.steps):
            mode = "step" if i % 2 == 0 else "eager"
            module.use_cpu_step = mode == "step"
            start = time.perf_counter()
            seqs.step([[5]])
            times[mode].append(time.perf_counter() - start)
    finally:
        for p in competitors:
            p.terminate()
    assert module.cpu_step is not None, module.cpu_step_reason
    return {"guard": os.environ.get("LADDER_CPU_STALL_GUARD", "1"), "competitors": args.competitors,
            "threads": torch.get_num_threads(),
            **{f"{mode}_ms": statistics.median(t) * 1e3 for mode, t in times.items()},
            **{f"{mode}_p90_ms": sorted(t)[int(0.9 * len(t))] * 1e3 for mode, t in times.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    parser.add_argument("--quantization", default="w4a8")
    parser.add_argument("--steps", type=int, default=40, help="decode steps per mode (step, eager)")
    parser.add_argument("--context", type=int, default=100, help="prompt tokens before the timed steps")
    parser.add_argument("--competitors", default="0,1,2", help="busy processes beside the steps")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/shared_cores.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.competitors = int(args.competitors)
        print(json.dumps(child(args)))
        return 0
    rows = []
    for competitors in [int(c) for c in args.competitors.split(",")]:
        for guard in ("1", "0"):
            cmd = [sys.executable, __file__, "--child", "--quantization", args.quantization, "--steps",
                   str(args.steps), "--context", str(args.context), "--competitors", str(competitors)]
            if args.model:
                cmd += ["--model", args.model]
            out = subprocess.run(cmd, env={**os.environ, "LADDER_CPU_STALL_GUARD": guard}, capture_output=True,
                                 text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"competitors {competitors}, {'guard   ' if guard == '1' else 'no guard'}: one C++ call "
                  f"{r['step_ms']:7.2f} ms (p90 {r['step_p90_ms']:7.2f}), eager layers {r['eager_ms']:7.2f} ms "
                  f"(p90 {r['eager_p90_ms']:7.2f})", flush=True)
    print(f"\n{cpu_name()}, {os.cpu_count()} logical CPUs")
    print("| competitors | threads | C++ step, guard | C++ step, no guard | eager, guard | eager, no guard |")
    print("|---|---|---|---|---|---|")
    by = {(r["competitors"], r["guard"]): r for r in rows}

    def cell(r: dict, mode: str) -> str:
        return f"{r[f'{mode}_ms']:.2f} ms (p90 {r[f'{mode}_p90_ms']:.1f})"

    for competitors in sorted({r["competitors"] for r in rows}):
        on, off = by[(competitors, "1")], by[(competitors, "0")]
        print(f"| {competitors} | {on['threads']} | {cell(on, 'step')} | {cell(off, 'step')} | {cell(on, 'eager')} | "
              f"{cell(off, 'eager')} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model or "SmolLM2-135M-Instruct (embedded GGUF)",
                                    "quantization": args.quantization, "cpu": cpu_name(), "logical_cpus": os.cpu_count(),
                                    "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
