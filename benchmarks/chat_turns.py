"""A chat's later turns with and without the prefix cache, in one run on one loaded model: each turn's prompt holds
the one before it, its reply and a new message, as a chat client sends it. Prints the time to the first token of
every turn both ways and writes JSON. For a model with linear-attention layers (Qwen3.5) the cache keeps snapshots
of their states (engine/state_cache.py); for any other model its KV blocks.

    .venv/bin/python benchmarks/chat_turns.py --model FILE_OR_DIR [--first 1000] [--turns 4] [--reply 64]
        [--message 48] [--out benchmarks/results/chat_turns.json]

The prompts are random token ids (the model's text does not matter to the time), the replies the model's own
greedy tokens (`--reply` of them, ignoring EOS), so both engines see the same conversation.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_report import write_report  # benchmarks/, this script's directory

import model
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from model.quantization import resolve_quantization


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--first", type=int, default=1000, help="tokens of the first turn's prompt")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--reply", type=int, default=64)
    parser.add_argument("--message", type=int, default=48, help="tokens of each later turn's new message")
    parser.add_argument("--out", default="benchmarks/results/chat_turns.json")
    args = parser.parse_args()
    loaded = model.load(args.model, quantization=resolve_quantization("auto", "fp32", "cpu", args.model))  # serve's
    vocab = loaded.config.vocab_size
    length = args.first + args.turns * (args.reply + args.message) + 16
    engines = {name: LLM(loaded=loaded, max_num_seqs=2, max_model_len=length, enable_prefix_caching=caching)
               for name, caching in (("cached", True), ("plain", False))}
    rng = torch.Generator().manual_seed(0)
    conversation = torch.randint(0, vocab, (args.first,), generator=rng).tolist()
    first_token = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    reply = SamplingParams(max_tokens=args.reply, temperature=0, ignore_eos=True)
    rows = []
    print(f"{'turn':>4} {'prompt':>7} {'TTFT cached ms':>15} {'TTFT plain ms':>14} {'ratio':>6}")
    for turn in range(args.turns):
        seconds = {}
        for name, llm in engines.items():
            start = time.perf_counter()
            llm.generate([conversation], first_token)
            seconds[name] = time.perf_counter() - start
        rows.append({"turn": turn + 1, "prompt_tokens": len(conversation), "ttft_cached_s": seconds["cached"],
                     "ttft_plain_s": seconds["plain"], "ratio": seconds["plain"] / seconds["cached"]})
        print(f"{turn + 1:>4} {len(conversation):>7} {1000 * seconds['cached']:>15.0f} "
              f"{1000 * seconds['plain']:>14.0f} {seconds['plain'] / seconds['cached']:>5.1f}x", flush=True)
        answer = engines["cached"].generate([conversation], reply)[0].outputs[0].token_ids
        conversation = conversation + list(answer) + torch.randint(0, vocab, (args.message,), generator=rng).tolist()
    later = [r["ratio"] for r in rows[1:]]
    print(f"median ratio of the later turns: {statistics.median(later):.1f}x" if later else "")
    write_report(args.out, rows, model=args.model, quantization=loaded.quantization, first=args.first,
                 reply=args.reply, message=args.message)


if __name__ == "__main__":
    main()
