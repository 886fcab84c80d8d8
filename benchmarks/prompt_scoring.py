"""What scoring a prompt costs: the same prompts with one token out, with and without their log-probabilities
(SamplingParams.prompt_logprobs, the server's echo with logprobs), alternated in one engine, medians.

    .venv/bin/python benchmarks/prompt_scoring.py [--model M] [--prompts 8] [--prompt-len 512] [--top 1]
        [--rounds 3] [--out benchmarks/results/prompt_scoring.json]

The prefix cache is off, so both sides compute every prompt token; prompts are random token ids.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from bench_report import write_report  # benchmarks/, this script's directory

from engine.llm import LLM
from engine.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF directory or GGUF file (default: the embedded model)")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--top", type=int, default=1, help="alternatives per prompt token")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/prompt_scoring.json"))
    args = parser.parse_args()
    if min(args.prompts, args.prompt_len, args.rounds) < 1 or args.top < 0:
        parser.error("--prompts, --prompt-len and --rounds must be at least 1, --top at least 0")

    llm = LLM(args.model, quantization=args.quantization, enable_prefix_caching=False,
              max_model_len=args.prompt_len + 8)
    vocab = llm.engine.model.config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    sides = {"plain": SamplingParams(temperature=0, max_tokens=1),
             "scored": SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=args.top)}
    llm.generate(prompts[:1], sides["scored"])  # warm: kernels, the LM head over many rows
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, params in sides.items():
            started = time.perf_counter()
            outputs = llm.generate(prompts, params)
            seconds[name].append(time.perf_counter() - started)
            if name == "scored" and any(len(o.prompt_logprobs) != args.prompt_len - 1 for o in outputs):
                raise RuntimeError("a scored prompt came back without all its log-probabilities")
    tokens = args.prompts * args.prompt_len
    rows = [{"side": name, "median_s": statistics.median(s), "rounds_s": s,
             "prompt_tokens_per_s": tokens / statistics.median(s)} for name, s in seconds.items()]
    ratio = rows[1]["median_s"] / rows[0]["median_s"]
    print(f"{args.prompts} prompts x {args.prompt_len} tokens, one token out, {args.rounds} rounds alternated")
    print(f"{'side':<8}{'median s':>10}{'prompt tok/s':>14}")
    for row in rows:
        print(f"{row['side']:<8}{row['median_s']:>10.2f}{row['prompt_tokens_per_s']:>14.0f}")
    print(f"scored / plain: {ratio:.2f}x the time")
    write_report(str(args.out), rows, config=vars(args) | {"out": str(args.out)}, scored_over_plain=ratio,
                 date=time.strftime("%Y-%m-%d %H:%M:%S"))


if __name__ == "__main__":
    main()
