"""Reranking: `ladder serve --reranker on` (POST /v1/rerank) against transformers scoring the same prompts on the
same weights in this process, alternated round by round; medians of the rounds, and how far the scores are.

    .venv/bin/python benchmarks/rerank_bench.py [--model GGUF_OR_DIR] [--documents 64] [--rounds 3]
        [--batch 16] [--out benchmarks/results/rerank.json]

Each round ranks new documents (sentences of 8-120 random words) against one query, the same for every side.
ladder runs two servers, its CPU default for the file (`--quantization auto`: W4A8 for the embedded model's
Q4_1) and float32 (`none`), each with its prefix cache (the documents' prompts share the judging rule, the
instruction and the query; --no-prefix-caching computes every prompt whole); transformers runs float32 over
left-padded batches of --batch prompts sorted by length (little padding) and reads the last position's "no"
and "yes" logits, as Qwen3-Reranker's model card does. The prompts are the same ids on every side
(server/rerank.py). "max |diff|" is the largest difference from transformers' score.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch
from bench_report import write_report  # benchmarks/, this script's directory
from peer_embeddings import start, stop, texts_of

from model.default import default_model_path
from model.gguf_checkpoint import GGUFCheckpoint
from model.tokenizer import Tokenizer
from server.rerank import DEFAULT_INSTRUCTION, Reranker

QUERY = "Which of these sentences talks about a river near a mountain city?"


def transformers_scores(model, tokenizer: Tokenizer, documents: list[str], batch: int) -> list[float]:
    no_id, yes_id = tokenizer.token_to_id("no"), tokenizer.token_to_id("yes")
    prompts = [tokenizer.encode_chat(Reranker.messages(QUERY, d, DEFAULT_INSTRUCTION), True, enable_thinking=False)[1]
               for d in documents]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths: little padding
    scores = []
    with torch.inference_mode():
        for first in range(0, len(prompts), batch):
            rows = [prompts[i] for i in order[first:first + batch]]
            width = max(map(len, rows))
            ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])  # left padding: the last column is real
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
            positions = (mask.cumsum(1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]
            scores += torch.softmax(logits[:, [no_id, yes_id]].double(), 1)[:, 1].tolist()
    return [scores[k] for k in torch.tensor(order).argsort().tolist()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF directory or GGUF file (default: the embedded model)")
    parser.add_argument("--documents", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="transformers' batch size")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="ladder's servers without their prefix cache: every prompt computed whole")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/rerank.json"))
    args = parser.parse_args()
    if min(args.documents, args.rounds, args.batch) < 1:
        parser.error("--documents, --rounds and --batch must be at least 1")
    import transformers

    path = Path(args.model) if args.model else default_model_path()
    logs = Path(args.out).parent
    logs.mkdir(parents=True, exist_ok=True)
    servers = {}
    for port, quantization in ((8731, "auto"), (8732, "none")):
        url = f"http://127.0.0.1:{port}"
        command = [str(Path(sys.executable).parent / "ladder"), "serve", "--model", str(path), "--port", str(port),
                   "--reranker", "on", "--quantization", quantization, "--max-model-len", "2048",
                   *(["--no-prefix-caching"] if args.no_prefix_caching else [])]
        servers[f"ladder {quantization}"] = (url, start(command, url, "/ready", logs / f"rerank_{quantization}.log"))
    try:
        kwargs = {"gguf_file": path.name} if path.is_file() else {}
        hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent if path.is_file() else path,
                                                               dtype=torch.float32, **kwargs).eval()
        tokenizer = Tokenizer.from_gguf_metadata(GGUFCheckpoint(path).metadata, str(path)) if path.is_file() \
            else Tokenizer.from_hf_dir(path)

        def ladder(url: str, documents: list[str]) -> list[float]:
            response = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": documents,
                                                            "return_documents": False}, timeout=600)
            response.raise_for_status()
            scores = [0.0] * len(documents)
            for result in response.json()["results"]:
                scores[result["index"]] = result["relevance_score"]
            return scores

        runs = {name: (lambda docs, url=url: ladder(url, docs)) for name, (url, _) in servers.items()}
        runs["transformers fp32"] = lambda docs: transformers_scores(hf, tokenizer, docs, args.batch)
        for run in runs.values():  # warm: kernels, allocations
            run(texts_of(8, seed=999))
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        diffs: dict[str, float] = {name: 0.0 for name in runs}
        for round_index in range(args.rounds):
            documents = texts_of(args.documents, seed=round_index)
            scores = {}
            for name, run in runs.items():
                started = time.perf_counter()
                scores[name] = run(documents)
                seconds[name].append(time.perf_counter() - started)
            for name in runs:
                diffs[name] = max(diffs[name], max(abs(a - b) for a, b in zip(scores[name],
                                                                             scores["transformers fp32"])))
    finally:
        for _, proc in servers.values():
            stop(proc)
    base = statistics.median(seconds["transformers fp32"])
    rows = [{"side": name, "median_s": statistics.median(s), "rounds_s": s,
             "documents_per_s": args.documents / statistics.median(s),
             "speedup_vs_transformers": base / statistics.median(s), "max_abs_score_diff": diffs[name]}
            for name, s in seconds.items()]
    print(f"{args.documents} documents a round, {args.rounds} rounds alternated, {path.name}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'side':<20}{'median s':>10}{'docs/s':>9}{'vs transformers':>17}{'max |diff|':>12}")
    for row in rows:
        print(f"{row['side']:<20}{row['median_s']:>10.3f}{row['documents_per_s']:>9.1f}"
              f"{row['speedup_vs_transformers']:>16.2f}x{row['max_abs_score_diff']:>12.6f}")
    write_report(str(args.out), rows, model=str(path), documents=args.documents, batch=args.batch,
                 prefix_caching=not args.no_prefix_caching)


if __name__ == "__main__":
    main()
