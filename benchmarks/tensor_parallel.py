"""Tensor parallelism against one process, in one run: decode throughput at batch B, communication share.

The model is loaded once (the embedded model, W8A8 as `auto` picks it for a group of ranks); each round
runs the same greedy workload (B short random prompts, then decode) through one process with a thread per
core, one process with a thread per rank, and a group of N ranks, in turn, so all see the same machine load.
Reported per setup: output tokens/s (median over rounds), the ratio to the first (of the medians, and the
median of each round's ratio to the same round's first setup), rank 0's time in each
collective as a share of step time and per step, and how many prompts' tokens agree with one process.
A group runs once per attention split asked for (`--attention heads,sequences`).

    .venv/bin/python benchmarks/tensor_parallel.py --batch 32 --output-len 64 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.throughput import BenchConfig, make_workload
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from model.loader import load
from model.perplexity import corpus_text, perplexity
from parallel import tensor_parallel_model


def run_once(loaded, size: int, threads: int, attention: str, prompts: list[list[int]], output_len: int) -> dict:
    """One greedy run; `threads`: torch threads of one process (a group sets its own: cores / ranks);
    `attention`: how a group splits attention (heads or sequences)."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    engine = LLMEngine(EngineConfig(max_num_seqs=len(prompts), max_model_len=max(map(len, prompts)) + output_len + 1,
                                    kv_cache_memory_gib=0.25, tensor_parallel_size=size,
                                    tensor_parallel_attention=attention), loaded=loaded)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        for i, prompt in enumerate(prompts[:2]):  # first calls (the workers' too) stay out of the figures
            engine.add_request(f"warm-{i}", prompt[:8], params.replace(max_tokens=4))
        while engine.has_unfinished():
            engine.step()
        before = engine.stats.snapshot()
        tokens: dict[str, list[int]] = {}
        started = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        while engine.has_unfinished():
            for delta in engine.step():
                tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
        seconds = time.perf_counter() - started
        after = engine.stats.snapshot()
        threads = torch.get_num_threads()
    finally:
        engine.close()
        torch.set_num_threads(threads_before)
    step_seconds = sum(after["seconds"].values()) - sum(before["seconds"].values())
    steps = after["num_steps"] - before["num_steps"]
    comm = {op: s - before["communication"].get(op, 0.0) for op, s in after["communication"].items()}
    return {"seconds": seconds, "output_tokens_per_s": len(prompts) * output_len / seconds, "steps": steps,
            "step_seconds": step_seconds, "communication_seconds": comm,
            "tokens": [tokens[str(i)] for i in range(len(prompts))], "threads": threads}


def perplexities(loaded, size: int, num_tokens: int) -> dict[str, float]:
    """Perplexity of the built-in text on one process and on `size` ranks: equal under W8A8 (the ranks
    compute one process's logits bit for bit, parallel/shard.py), close under float32 (sums in another
    order)."""
    ids = loaded.tokenizer.encode(corpus_text())[:num_tokens]
    one = perplexity(loaded.module, ids)
    group = tensor_parallel_model.start(loaded, size)
    try:
        split = perplexity(group.module, ids)
    finally:
        group.module.close()
    return {"one_process": one, f"{size}_ranks": split, "tokens": len(ids)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    # One scheme for every setup; w8a8 is what `auto` picks for a group of ranks on a CPU.
    parser.add_argument("--quantization", default="w8a8", choices=["w8a8", "int8", "none"])
    parser.add_argument("--size", type=int, default=2, help="ranks to compare with one process")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--attention", default="heads,sequences",
                        help="comma-separated attention splits to run a group with (heads, sequences)")
    parser.add_argument("--perplexity-tokens", type=int, default=1024, help="0: skip the perplexity check")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/tensor_parallel.json"))
    args = parser.parse_args()
    quantization = args.quantization
    loaded = load(args.model, quantization=quantization)
    config = BenchConfig(num_prompts=args.batch, input_len=args.input_len, output_len=args.output_len)
    special = loaded.tokenizer.special_ids if loaded.tokenizer else frozenset()
    prompts = make_workload(config, loaded.config.vocab_size, special).prompts
    cores = torch.get_num_threads()
    # One process with every core's thread (the baseline), one process with a thread per rank (what each
    # rank of the group gets), and the group with each attention split.
    splits = args.attention.split(",")
    setups = {(1, cores, "-"): [], (1, max(1, cores // args.size), "-"): [],
              **{(args.size, cores, split): [] for split in splits}}
    loads = []
    for _ in range(args.rounds):
        for size, threads, split in setups:
            loads.append(Path("/proc/loadavg").read_text().split()[0])
            setups[size, threads, split].append(run_once(loaded, size, threads, "heads" if split == "-" else split,
                                                         prompts, args.output_len))
    rows = []
    one_process = setups[1, cores, "-"]
    baseline = statistics.median(r["output_tokens_per_s"] for r in one_process)
    for (size, _, split), results in setups.items():
        best = statistics.median(r["output_tokens_per_s"] for r in results)
        step_s = sum(r["step_seconds"] for r in results)
        comm = {op: sum(r["communication_seconds"].get(op, 0.0) for r in results)
                for op in ("broadcast", "all_reduce", "all_reduce_max", "all_gather", "gather")}
        steps = sum(r["steps"] for r in results)
        agree = sum(a == b for a, b in zip(results[-1]["tokens"], one_process[-1]["tokens"]))
        # Each round's ratio to the same round's baseline: the machine's speed drifts between rounds more
        # than between the setups of one round.
        per_round = [r["output_tokens_per_s"] / b["output_tokens_per_s"] for r, b in zip(results, one_process)]
        rows.append({"ranks": size, "attention": split, "threads_per_rank": results[-1]["threads"],
                     "output_tokens_per_s": [r["output_tokens_per_s"] for r in results],
                     "median_output_tokens_per_s": best, "ratio_to_one_process": best / baseline,
                     "ratio_per_round": per_round, "median_ratio_per_round": statistics.median(per_round),
                     "communication_share": {op: s / step_s for op, s in comm.items()},
                     "communication_ms_per_step": {op: s / steps * 1e3 for op, s in comm.items()},
                     "step_ms": step_s / steps * 1e3, "prompts_with_one_process_tokens": agree})
    header = (f"{'ranks':>5}{'split':>10}{'threads':>8}{'out tok/s':>11}{'vs 1 proc':>10}{'per round':>10}{'step ms':>9}{'all-reduce':>11}"
              f"{'max':>7}{'allgath':>8}{'gather':>8}{'bcast':>7}{'comm ms/step':>13}{'same tokens':>12}")
    print(f"{loaded.name} ({quantization}), batch {args.batch}, {args.input_len} prompt + {args.output_len} output "
          f"tokens, {args.rounds} rounds, load averages {' '.join(loads)}")
    print(header)
    print("-" * len(header))
    for row in rows:
        share = row["communication_share"]
        print(f"{row['ranks']:>5}{row['attention']:>10}{row['threads_per_rank']:>8}{row['median_output_tokens_per_s']:>11.1f}"
              f"{row['ratio_to_one_process']:>9.2f}x{row['median_ratio_per_round']:>9.2f}x"
              f"{row['step_ms']:>9.1f}{share['all_reduce']:>11.1%}"
              f"{share['all_reduce_max']:>7.1%}{share['all_gather']:>8.1%}{share['gather']:>8.1%}{share['broadcast']:>7.1%}"
              f"{sum(row['communication_ms_per_step'].values()):>13.2f}"
              f"{row['prompts_with_one_process_tokens']:>9}/{args.batch}")
    ppl = perplexities(loaded, args.size, args.perplexity_tokens) if args.perplexity_tokens else None
    if ppl is not None:
        print(f"perplexity over {ppl['tokens']} tokens of the built-in text: one process {ppl['one_process']:.3f}, "
              f"{args.size} ranks {ppl[f'{args.size}_ranks']:.3f} "
              f"({ppl[f'{args.size}_ranks'] / ppl['one_process'] - 1:+.2%})")
    report = {"model": loaded.name, "perplexity": ppl, "quantization": quantization, "batch": args.batch,
              "input_len": args.input_len, "output_len": args.output_len, "rounds": args.rounds,
              "load_averages": loads, "rows": rows,
              "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "torch": torch.__version__}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
