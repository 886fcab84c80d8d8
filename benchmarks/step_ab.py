"""Engine steps of this checkout against a git revision, alternated process by process.

    .venv/bin/python benchmarks/step_ab.py --against REV [--model NAME] [--rounds 5] [--prompt-len 100]
                                           [--batch 1] [--prefill] [--cflags "-mno-avx512f"]
                                           [--out benchmarks/results/step_ab.json]

REV is checked out in a temporary git worktree; each round runs one child process per side (the order
turning each round), each loading the model as `ladder serve` would (`--quantization auto`) and timing
`LLMEngine.step`: by default over 128 decode steps of --batch requests at once (their prompts prefilled
first), three times greedy and three at temperature 1; with --prefill, the steps that prefill one prompt of
--prompt-len tokens, three times (the time to the first token, less the HTTP and the tokenizer). A side's C++
kernels are built from its own sources (cached by digest; --cflags adds compiler flags to both, e.g.
-mno-avx512f for the AVX2 paths). The table gives the median of the rounds' medians and their ratio: what a
change costs or saves end to end, on a machine whose speed drifts between runs.
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
model, prompt_len, batch, prefill = sys.argv[1] or None, int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
engine = LLM(model, quantization="auto").engine
result = {}
for temperature in (0.0,) if prefill else (0.0, 1.0):
    times = []
    for rep in range(3):
        params = SamplingParams(temperature=temperature, max_tokens=1 if prefill else 129, ignore_eos=True, seed=rep)
        for b in range(1 if prefill else batch):  # prompts that share no prefix
            prompt = [1 + (7 * j + 131 * b + 17 * rep) % 1000 for j in range(prompt_len)]
            engine.add_request(f"r{temperature}-{rep}-{b}", prompt, params)
        if prefill:
            start = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            times.append(time.perf_counter() - start)
            continue
        started = set()  # the prefills: until every request has its first token
        while len(started) < batch:
            started |= {d.request_id for d in engine.step() if d.token_ids}
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
    result["prefill" if prefill else f"T={temperature}"] = statistics.median(times) * 1e3
print("RESULT " + json.dumps(result))
"""


def measure(checkout: Path, model: str, prompt_len: int, batch: int, prefill: bool, cflags: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(checkout), "LADDER_CPU_CFLAGS": cflags}
    run = subprocess.run([sys.executable, "-c", CHILD, model, str(prompt_len), str(batch), str(int(prefill))],
                         cwd=checkout, env=env,
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
    parser.add_argument("--batch", type=int, default=1, help="requests decoding at once")
    parser.add_argument("--prefill", action="store_true", help="time one prompt's prefill instead of decodes")
    parser.add_argument("--cflags", default="", help="LADDER_CPU_CFLAGS for both sides")
    parser.add_argument("--out", default="benchmarks/results/step_ab.json")
    args = parser.parse_args()
    if args.batch < 1 or args.prompt_len < 1 or args.rounds < 1:
        parser.error("--batch, --prompt-len and --rounds must be at least 1")
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
                    runs[name].append(measure(checkout, args.model, args.prompt_len, args.batch, args.prefill,
                                             args.cflags))
                    print(f"round {rnd + 1}: {name}: " + ", ".join(f"{k} {v:.3f} ms"
                                                                    for k, v in runs[name][-1].items()), flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)], check=False)
    rows = []
    what = f"prefill of {args.prompt_len} tokens" if args.prefill else \
        f"decode step of {args.batch} request(s), {args.prompt_len}-token prompts"
    print(f"\nmodel {args.model or 'default'}, cflags '{args.cflags}', {args.rounds} rounds: {what}, ms (median of "
          f"rounds)")
    print(f"{'case':>11} | {'this':>8} {args.against:>12} | {'this / it':>9}")
    for case in runs["this"][0]:
        medians = {name: statistics.median(r[case] for r in runs[name]) for name in runs}
        ratio = medians["this"] / medians[args.against]
        rows.append({"case": case, "median_ms": medians, "ratio": ratio,
                     "rounds_ms": {name: [r[case] for r in runs[name]] for name in runs}})
        print(f"{case:>11} | {medians['this']:>8.3f} {medians[args.against]:>12.3f} | {ratio:>9.3f}")
    write_report(args.out, rows, against=args.against, model=args.model or "default", cflags=args.cflags,
                 prompt_len=args.prompt_len, batch=args.batch, prefill=args.prefill, rounds=args.rounds)


if __name__ == "__main__":
    main()
