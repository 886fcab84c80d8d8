"""Speculative decoding by prompt lookup against plain decoding, in one process and one run.

Two workloads through the chat template of the model served: one whose answers copy their input (repeat,
correct or reformat a given text) and one whose answers do not (poems, stories, explanations). Each runs
greedy with `speculative_tokens` 0 (the baseline) and each K asked, at one user (requests one after
another) and at several (sent together), in alternated rounds; the table gives medians over the rounds
of output tokens/s, decode tokens/s (first token to last, per request) and the ratio to the baseline of
the same round, the draft acceptance, and whether every greedy text equals the baseline's.

    .venv/bin/python benchmarks/speculative_bench.py [--tokens 4,8] [--users 1,4] [--rounds 3]
        [--max-tokens 128] [--model PATH] [--quantization auto] [--out benchmarks/results/speculative.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.stats import RequestTiming

PASSAGES = [
    "The scheduler runs every step with a token budget. Running requests go first, oldest first; waiting "
    "requests are admitted while the budget, the sequence slots and the cache blocks last. When blocks run "
    "out, the most recently admitted request is preempted and computed again later.",
    "Paris is the capital of France. It lies on the Seine, in the north of the country, and is known for "
    "its museums, its cafes and the Eiffel Tower, which was built for the World's Fair of 1889.",
    "To install the package, create a virtual environment, activate it, and run pip install with the "
    "server extra. Then start the server with the default model and open the page it prints.",
    "Water boils at one hundred degrees Celsius at sea level. At higher altitudes the air pressure is "
    "lower, so water boils at a lower temperature, and food takes longer to cook.",
]
COPY_TASKS = [
    "Repeat the following text exactly, word for word:\n\n{}",
    "Correct any mistakes in the following text and return the whole text:\n\n{}",
    "Rewrite the following text as a bulleted list, keeping its wording:\n\n{}",
    "Quote the following paragraph back to me:\n\n{}",
]
FREE_PROMPTS = [
    "Write a short poem about the sea.",
    "Tell me a story about a dragon who learns to cook.",
    "Explain how a rainbow forms.",
    "What are three tips for learning a new language?",
    "Describe your ideal weekend.",
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
    "Give me a recipe idea for dinner tonight.",
]


def workloads() -> dict[str, list[list[dict]]]:
    copy = [[{"role": "user", "content": task.format(passage)}]
            for task in COPY_TASKS for passage in PASSAGES[:2]]
    free = [[{"role": "user", "content": prompt}] for prompt in FREE_PROMPTS]
    return {"copy": copy, "free": free}


def run_once(llm: LLM, conversations: list[list[dict]], k: int, users: int, max_tokens: int) -> dict:
    """Greedy answers to every conversation, `users` at a time; tokens/s, decode tokens/s, texts, drafts."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, speculative_tokens=k)
    prompts = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template(c), add_special_tokens=False)
               for c in conversations]
    timings: list[RequestTiming] = []
    stats = llm.engine.stats
    stats.observers.append(timings.append)
    drafts, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    texts: list[list[int]] = []
    start = time.perf_counter()
    try:
        for i in range(0, len(prompts), users):
            texts.extend(out.outputs[0].token_ids for out in llm.generate(prompts[i:i + users], params))
    finally:
        stats.observers.remove(timings.append)
    wall = time.perf_counter() - start
    tokens = sum(map(len, texts))
    decode = [(t.num_output_tokens - 1) / t.decode for t in timings if t.decode and t.num_output_tokens > 1]
    proposed = stats.num_draft_tokens - drafts
    return {"tokens_per_s": tokens / wall, "decode_tokens_per_s": statistics.median(decode), "tokens": tokens,
            "wall_s": wall, "texts": texts, "drafts": proposed,
            "acceptance": (stats.num_accepted_tokens - accepted) / proposed if proposed else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="4,8", help="draft tokens per step to measure (comma-separated)")
    parser.add_argument("--users", default="1,4", help="requests in flight (comma-separated)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--model", default=None)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/speculative.json"))
    parser.add_argument("--write-datasets", type=Path, default=None, metavar="DIR",
                        help="write the workloads as DIR/copy.jsonl and DIR/free.jsonl (for `ladder loadtest "
                             "--dataset file` and benchmarks/peer_llamacpp.sh --dataset) and stop")
    args = parser.parse_args()
    if args.write_datasets is not None:
        args.write_datasets.mkdir(parents=True, exist_ok=True)
        for name, conversations in workloads().items():
            lines = [json.dumps({"messages": c}) for c in conversations]
            (args.write_datasets / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
            print(f"wrote {args.write_datasets / f'{name}.jsonl'} ({len(lines)} conversations)")
        return
    ks = [int(k) for k in args.tokens.split(",")]
    users_list = [int(u) for u in args.users.split(",")]
    llm = LLM(args.model, quantization=args.quantization, max_num_seqs=max(users_list),
              speculative_max_batch=max(users_list))
    config = llm.engine.config
    for conversation in workloads()["free"][:1]:  # warm up
        run_once(llm, [conversation], 0, 1, 8)
    rows = []
    for name, conversations in workloads().items():
        for users in users_list:
            rounds: dict[int, list[dict]] = {k: [] for k in [0, *ks]}
            for _ in range(args.rounds):
                for k in [0, *ks]:  # alternated: each round measures every K beside its baseline
                    rounds[k].append(run_once(llm, conversations, k, users, args.max_tokens))
            base = rounds[0]
            for k in [0, *ks]:
                runs = rounds[k]
                ratio = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs, base)]
                rows.append({
                    "workload": name, "users": users, "speculative_tokens": k,
                    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                    "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in runs),
                    "ratio": statistics.median(ratio), "ratios": ratio,
                    "acceptance": runs[0]["acceptance"],
                    "drafts_per_round": runs[0]["drafts"],
                    "same_text": all(r["texts"] == b["texts"] for r, b in zip(runs, base)),
                    "tokens": runs[0]["tokens"],
                })
    header = f"{'workload':8} {'users':>5} {'K':>3} {'tok/s':>8} {'decode tok/s':>13} {'ratio':>6} " \
             f"{'accepted':>9} {'same text':>9}"
    print(f"speculative decoding, {config.quantization}, {platform.processor() or platform.machine()}, "
          f"median of {args.rounds} alternated rounds, {args.max_tokens} tokens max")
    print(header)
    for r in rows:
        accepted = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        print(f"{r['workload']:8} {r['users']:>5} {r['speculative_tokens']:>3} {r['tokens_per_s']:>8.1f} "
              f"{r['decode_tokens_per_s']:>13.1f} {r['ratio']:>5.2f}x {accepted:>9} {str(r['same_text']):>9}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"quantization": config.quantization, "dtype": config.dtype,
                                    "rounds": args.rounds, "max_tokens": args.max_tokens, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
