"""The batched sampler against the full-sort sampler it replaced, in one run.

    .venv/bin/python benchmarks/sampler_bench.py [--batches 1,8,32] [--vocab 49152] [--reps 15] [--threads T]
                                                 [--against REV] [--out benchmarks/results/sampler.json]
    .venv/bin/python benchmarks/sampler_bench.py --engine --against REV [--batches 1,32]

--engine: the default model decodes through the engine (`--quantization auto`, as served) with this
sampler and with the one at REV in turns, greedy and at temperature 1: what sampling costs where it runs,
right after a forward pass has pushed the sampler's code out of the caches (which calls on their own,
below, do not see). Prints ms per decode step and writes benchmarks/results/sampler_engine.json.

--against REV also times engine/sampler.py as it was at git revision REV, in the same run and on the same
logits: what a change to the sampler costs. Its tokens are compared and "(other tokens)" marks a case where
they differ: revisions before the uniform numbers came from Python's generators (not torch's) draw others.

Logits are Gaussian with a spread of 2.8, which at temperature 0.7 gives a next-token entropy near three
nats, as a chat model's typically is; "flat" rows (spread 0.3) put the top-p nucleus at thousands of
tokens, the case that still sorts in full. Every request is seeded, and both samplers must return the
same tokens on every call (checked). Times are medians of single calls, the samplers taking turns in an
order that rotates each call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import types

import torch

from bench_report import write_report  # benchmarks/, this script's directory
from engine.request import Request
from engine.sampler import Sampler
from engine.sampler_ref import FullSortSampler
from engine.sampling_params import SamplingParams

SCENARIOS = {  # name: (sampling parameters, logit spread)
    "greedy": (dict(temperature=0.0), 2.8),
    "temperature 0.7": (dict(temperature=0.7), 2.8),
    "top_p 0.9": (dict(temperature=0.7, top_p=0.9), 2.8),
    "top_k 50": (dict(temperature=0.7, top_k=50), 2.8),
    "top_k 50 top_p 0.9 min_p 0.05": (dict(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05), 2.8),
    "top_p 0.9, flat": (dict(temperature=0.7, top_p=0.9), 0.3),
}


def timed(sampler: Sampler, logits: torch.Tensor, requests: list[Request]) -> tuple[float, list[int]]:
    start = time.perf_counter()
    out = sampler(logits, requests)
    return time.perf_counter() - start, out.token_ids


def sampler_at(revision: str) -> type[Sampler]:
    """The Sampler class of engine/sampler.py at a git revision, loaded beside the working tree's."""
    source = subprocess.run(["git", "show", f"{revision}:engine/sampler.py"], check=True, capture_output=True,
                            text=True).stdout
    name = f"sampler_at_{revision.replace('~', '_').replace('^', '_')}"
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, f"{revision}:engine/sampler.py", "exec"), module.__dict__)
    return module.Sampler


def engine_run(batches: list[int], against: str, rounds: int = 3, tokens: int = 64) -> None:
    """Decode steps of the default model with this sampler and the one at `against`, alternated."""
    from engine.llm import LLM

    earlier = sampler_at(against)
    llm = LLM(quantization="auto")
    engine = llm.engine
    ours = engine.sampler
    rows = []
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}; ms per decode step "
          f"({tokens} tokens a request, median of {rounds} rounds)")
    print(f"{'batch':>5} {'temperature':>11} | {'ours':>8} {against:>10} | {'ours / it':>9}")
    for batch in batches:
        prompts = [[1 + (7 * i + j) % 1000 for j in range(16)] for i in range(batch)]
        for temperature in (0.0, 1.0):
            params = SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True, seed=0)
            times: dict[str, list[float]] = {"ours": [], "earlier": []}
            for rnd in range(rounds + 1):
                for key in (("ours", "earlier") if rnd % 2 else ("earlier", "ours")):
                    engine.sampler = ours if key == "ours" else earlier(0)
                    llm.generate(prompts, params.replace(max_tokens=2))  # the prefill's path, warm
                    start = time.perf_counter()
                    llm.generate(prompts, params)
                    if rnd:  # round 0 warms up
                        times[key].append((time.perf_counter() - start) / tokens * 1e3)
            medians = {k: statistics.median(v) for k, v in times.items()}
            rows.append({"batch": batch, "temperature": temperature, "ms_per_step": medians, "rounds": times})
            print(f"{batch:>5} {temperature:>11} | {medians['ours']:>8.3f} {medians['earlier']:>10.3f} | "
                  f"{medians['ours'] / medians['earlier']:>9.2f}")
    engine.sampler = ours
    write_report("benchmarks/results/sampler_engine.json", rows, against=against, tokens=tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--vocab", type=int, default=49_152)
    parser.add_argument("--reps", type=int, default=15, help="timed calls per sampler and case")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--against", default=None, metavar="REV", help="also time the sampler at this git revision")
    parser.add_argument("--out", default="benchmarks/results/sampler.json")
    parser.add_argument("--engine", action="store_true", help="decode steps of the default model (needs --against)")
    args = parser.parse_args()
    if args.engine:
        if not args.against:
            parser.error("--engine compares against a revision: give --against REV")
        engine_run([int(v) for v in args.batches.split(",")], args.against)
        return
    earlier = sampler_at(args.against) if args.against else None
    if args.threads:
        torch.set_num_threads(args.threads)

    gen = torch.Generator().manual_seed(0)
    rows = []
    header = f"{'batch':>5} {'scenario':<30} | {'full sort ms':>12} {'ours ms':>8} | {'speed-up':>8}"
    if earlier is not None:
        header += f" | {args.against + ' ms':>14} {'ours / it':>9}"
    print(f"threads {torch.get_num_threads()}, vocab {args.vocab}, load average {os.getloadavg()[0]:.2f}")
    print(header)
    print("-" * len(header))
    for batch in [int(v) for v in args.batches.split(",")]:
        for name, (params, spread) in SCENARIOS.items():
            requests = [Request(f"r{i}", [0], SamplingParams(**params, seed=i)) for i in range(batch)]
            samplers = {"full_sort": FullSortSampler(), "ours": Sampler()}
            if earlier is not None:
                samplers["earlier"] = earlier()
            times: dict[str, list[float]] = {k: [] for k in samplers}
            earlier_same = True
            for rep in range(args.reps + 2):
                logits = torch.randn(batch, args.vocab, generator=gen) * spread
                tokens = {}
                # The order turns each rep: a sampler that runs right after another finds the logits in cache.
                order = list(samplers.items())
                for key, sampler in order[rep % len(order):] + order[:rep % len(order)]:
                    seconds, tokens[key] = timed(sampler, logits, requests)
                    if rep >= 2:  # two warm-up calls
                        times[key].append(seconds)
                if tokens["ours"] != tokens["full_sort"]:
                    raise SystemExit(f"{name}, batch {batch}: the tokens differ: {tokens['ours']} vs "
                                     f"{tokens['full_sort']}")
                if earlier is not None:
                    earlier_same &= tokens["earlier"] == tokens["ours"]
            medians = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            speedup = medians["full_sort"] / medians["ours"]
            rows.append({"batch": batch, "scenario": name, "params": params, "logit_spread": spread,
                         "median_ms": medians, "speedup": speedup, "load_average_1min": os.getloadavg()[0]})
            line = f"{batch:>5} {name:<30} | {medians['full_sort']:>12.2f} {medians['ours']:>8.2f} | {speedup:>8.2f}"
            if earlier is not None:
                rows[-1]["earlier_same_tokens"] = earlier_same
                line += f" | {medians['earlier']:>14.3f} {medians['ours'] / medians['earlier']:>9.2f}"
                line += "" if earlier_same else "  (other tokens)"
            print(line)
    write_report(args.out, rows, vocab=args.vocab, reps=args.reps, against=args.against)


if __name__ == "__main__":
    main()
