"""Batch-1 engine decode steps of this checkout against a git revision, alternated process by process.

    .venv/bin/python benchmarks/step_ab.py --against REV [--model NAME] [--rounds 5] [--prompt-len 100]
                                           [--cflags "-mno-avx512f"] [--out benchmarks/results/step_ab.json]

REV is checked out in a temporary git worktree; each round runs one child process per side (the order
turning each round), each loading the model as `ladder serve` would (`--quantization auto`) and timing
`LLMEngine.step` over 128 decode steps of one request, three requests greedy and three at temperature 1.
A side's C++ kernels are built from its own sources (cached by digest; --cflags adds compiler flags to
both, e.g. -mno-avx512f for the AVX2 paths). The table gives the median of the rounds' median step times
and their ratio: what a change costs or saves end to end on one stream, on a machine whose speed drifts
between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_report import write_report  # benchmarks/, this script's directory

ROOT = Path(__file__).resolve().parents[1]

# One side's measurement, run in a child process from that side's checkout (sys.path[0] is the checkout).
CHILD = """
import json, statistics, sys, time
from engine.llm import LLM
from engine.sampling_params import SamplingParams
model, prompt_len = sys.argv[1] or None, int(sys.argv[2])
engine = LLM(model, quantization="auto").engine
prompt = [1 + (7 * j) % 1000 for j in range(prompt_len)]
result = {}
for temperature in (0.0, 1.0):
    times = []
    for rep in range(3):
        params = SamplingParams(temperature=temperature, max_tokens=129, ignore_eos=True, seed=rep)
        engine.add_request(f"r{temperature}-{rep}", prompt, params)
        engine.step()  # the prefill
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
    result[str(temperature)] = statistics.median(times) * 1e3
print("RESULT " + json.dumps(result))
"""


def measure(checkout: Path, model: str, prompt_len: int, cflags: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(checkout), "LADDER_CPU_CFLAGS": cflags}
    run = subprocess.run([sys.executable, "-c", CHILD, model, str(prompt_len)], cwd=checkout, env=env,
                         capture_output=True, text=True, check=False, timeout=1800)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    if run.returncode != 0 or not lines:
        raise SystemExit(f"the run in {checkout} failed:\n{run.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, metavar="REV", help="the git revision to compare with")
    parser.add_argument("--model", default="", help="a packaged model's name or a path (default: the embedded one)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--cflags", default="", help="LADDER_CPU_CFLAGS for both sides")
    parser.add_argument("--out", default="benchmarks/results/step_ab.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ladder-ab-") as tmp:
        other = Path(tmp) / "checkout"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(other), args.against],
                       check=True)
        try:
            sides = {"this": ROOT, args.against: other}
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
            for rnd in range(args.rounds):
                order = list(sides.items()) if rnd % 2 == 0 else list(sides.items())[::-1]
                for name, checkout in order:
                    runs[name].append(measure(checkout, args.model, args.prompt_len, args.cflags))
                    print(f"round {rnd + 1}: {name}: " + ", ".join(f"T={k} {v:.3f} ms"
                                                                    for k, v in runs[name][-1].items()), flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)], check=False)
    rows = []
    print(f"\nmodel {args.model or 'default'}, cflags '{args.cflags}', {args.rounds} rounds, prompt "
          f"{args.prompt_len} tokens: batch-1 decode step, ms (median of rounds)")
    print(f"{'temperature':>11} | {'this':>8} {args.against:>12} | {'this / it':>9}")
    for temperature in ("0.0", "1.0"):
        medians = {name: statistics.median(r[temperature] for r in runs[name]) for name in runs}
        ratio = medians["this"] / medians[args.against]
        rows.append({"temperature": float(temperature), "median_ms": medians, "ratio": ratio,
                     "rounds_ms": {name: [r[temperature] for r in runs[name]] for name in runs}})
        print(f"{temperature:>11} | {medians['this']:>8.3f} {medians[args.against]:>12.3f} | {ratio:>9.3f}")
    write_report(args.out, rows, against=args.against, model=args.model or "default", cflags=args.cflags,
                 prompt_len=args.prompt_len, rounds=args.rounds)


if __name__ == "__main__":
    main()
