"""Embeddings: ladder's engine (`LLM.embed`, what /v1/embeddings runs) against transformers on the same weights,
alternated in one process, medians of the rounds.

    .venv/bin/python benchmarks/embeddings_bench.py [--model M] [--inputs 64] [--min-len 16] [--max-len 256]
        [--batch 16] [--rounds 3] [--out benchmarks/results/embeddings.json]

Inputs are random token ids of random lengths, the prefix cache off. transformers runs its base model
(`AutoModel`) in float32 over right-padded batches of `--batch` inputs of similar lengths and takes each row's
last real token; ladder runs float32 (`none`, the same
numbers: the table gives the smallest cosine similarity to transformers' vectors) and its CPU default for the
file (`auto`: W4A8 for a Q4/Q5/Q6 GGUF).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch
from bench_report import write_report  # benchmarks/, this script's directory

from engine.llm import LLM
from model.default import default_model_path


def transformers_embed(model, prompts: list[list[int]], batch: int) -> torch.Tensor:
    """Batches of similar lengths (sorted, as sentence-transformers' encode does), so padding costs little."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out = []
    with torch.inference_mode():
        for first in range(0, len(prompts), batch):
            rows = [prompts[i] for i in order[first:first + batch]]
            width = max(map(len, rows))
            ids = torch.tensor([p + [0] * (width - len(p)) for p in rows])
            mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in rows])
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = hidden[torch.arange(len(rows)), torch.tensor([len(p) - 1 for p in rows])]
            out.append(torch.nn.functional.normalize(last.float(), dim=1))
    return torch.cat(out)[torch.tensor(order).argsort()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF directory or GGUF file (default: the embedded model)")
    parser.add_argument("--inputs", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16, help="transformers' batch size")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/embeddings.json"))
    args = parser.parse_args()
    if min(args.inputs, args.min_len, args.batch, args.rounds) < 1 or args.max_len < args.min_len:
        parser.error("--inputs, --min-len, --batch and --rounds must be at least 1, --max-len at least --min-len")
    import transformers

    path = Path(args.model) if args.model else default_model_path()
    # No prefix cache: the rounds repeat the inputs, and a cached input would compute only its last token.
    sides = {f"ladder {q}": LLM(str(path), quantization=q, max_model_len=args.max_len + 8, enable_prefix_caching=False)
             for q in ("none", "auto")}
    kwargs = {"gguf_file": path.name} if path.is_file() else {}
    hf = transformers.AutoModel.from_pretrained(path.parent if path.is_file() else path, dtype=torch.float32,
                                                **kwargs).eval()
    llm = next(iter(sides.values()))
    vocab, special = llm.engine.model.config.vocab_size, llm.tokenizer.special_ids
    rng = random.Random(0)
    ordinary = [t for t in range(vocab) if t not in special]
    prompts = [[rng.choice(ordinary) for _ in range(rng.randint(args.min_len, args.max_len))]
               for _ in range(args.inputs)]
    runs = {name: (lambda llm=llm: llm.embed(prompts)) for name, llm in sides.items()}
    runs["transformers fp32"] = lambda: transformers_embed(hf, prompts, args.batch)
    for run in runs.values():  # warm: kernels, allocations
        run()
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    vectors: dict[str, torch.Tensor] = {}
    for _ in range(args.rounds):
        for name, run in runs.items():
            started = time.perf_counter()
            vectors[name] = run()
            seconds[name].append(time.perf_counter() - started)
    base = statistics.median(seconds["transformers fp32"])
    tokens = sum(map(len, prompts))
    rows = []
    for name, s in seconds.items():
        cosine = (vectors[name] * vectors["transformers fp32"]).sum(1)
        rows.append({"side": name, "median_s": statistics.median(s), "rounds_s": s,
                     "inputs_per_s": args.inputs / statistics.median(s), "tokens_per_s": tokens / statistics.median(s),
                     "speedup_vs_transformers": base / statistics.median(s), "min_cosine_to_transformers":
                     float(cosine.min())})
    print(f"{args.inputs} inputs of {args.min_len}-{args.max_len} tokens ({tokens} in all), {args.rounds} rounds "
          f"alternated, {path.name}, {torch.get_num_threads()} threads")
    print(f"{'side':<20}{'median s':>10}{'inputs/s':>10}{'tok/s':>9}{'vs transformers':>17}{'min cosine':>12}")
    for row in rows:
        print(f"{row['side']:<20}{row['median_s']:>10.3f}{row['inputs_per_s']:>10.1f}{row['tokens_per_s']:>9.0f}"
              f"{row['speedup_vs_transformers']:>16.2f}x{row['min_cosine_to_transformers']:>12.6f}")
    write_report(str(args.out), rows, model=str(path), inputs=args.inputs, tokens=tokens, batch=args.batch)


if __name__ == "__main__":
    main()
