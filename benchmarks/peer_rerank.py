"""Reranking by `ladder serve` against llama.cpp's server (`--reranking`) on the same reranker GGUF file, one server
at a time on the same cores, the same query and documents through POST /v1/rerank, alternated; and how close
their scores are.

    .venv/bin/python benchmarks/synthetic_gguf.py --reranker --out /tmp/qwen3-reranker-0.6b-shape.gguf \
        --hidden 1024 --layers 28 --intermediate 3072 --heads 16 --kv-heads 8 --head-dim 128
    .venv/bin/python benchmarks/peer_rerank.py --model /tmp/qwen3-reranker-0.6b-shape.gguf [--documents 64]
        [--rounds 4] [--out benchmarks/results/peer_rerank.json]

The file is a Qwen3 reranker as llama.cpp converts Qwen3-Reranker (pooling type rank, the "yes" and "no"
rows of the head as `cls.output.weight`, a `rerank` template); synthetic_gguf.py writes one with random
blocks and a template that gives llama.cpp the same prompt ladder writes through the chat template (the
two servers' usage counts the same tokens, checked). llama-server comes from `benchmarks/peer_llamacpp.sh
--build-only` (cached in $LADDER_PEER_CACHE; or --llama-server) with `--reranking`, 4 slots and each slot's
batch as large as a prompt; ladder runs its defaults (W4A8 on the file's blocks, its prefix cache;
--no-prefix-caching computes every prompt whole). Each
round sends one request of --documents new documents (8-120 random words each), the same to both.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import httpx
from bench_report import write_report  # benchmarks/, this script's directory
from peer_embeddings import ROOT, llama_server, start, stop, texts_of

QUERY = "Which of these sentences talks about a river near a mountain city?"


def rerank(url: str, model: str, documents: list[str]) -> tuple[float, list[float], int]:
    """Seconds, scores in document order, prompt tokens."""
    import time

    started = time.perf_counter()
    response = httpx.post(url + "/v1/rerank", json={"model": model, "query": QUERY, "documents": documents,
                                                    "top_n": len(documents)}, timeout=1200)
    took = time.perf_counter() - started
    response.raise_for_status()
    body = response.json()
    scores = [0.0] * len(documents)
    for result in body["results"]:
        scores[result["index"]] = result["relevance_score"]
    return took, scores, body["usage"]["prompt_tokens"]


def ranks(values: list[float]) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0] * len(values)
    for rank, i in enumerate(order):
        out[i] = rank
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a reranker GGUF (synthetic_gguf.py --reranker)")
    parser.add_argument("--documents", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--port", type=int, default=8193)
    parser.add_argument("--llama-server", type=Path, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="ladder without its prefix cache: every document's prompt computed whole")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/peer_rerank.json"))
    args = parser.parse_args()
    if min(args.documents, args.rounds) < 2:
        parser.error("--documents and --rounds must be at least 2")
    server_bin = llama_server(args.llama_server, "peer_rerank")
    url = f"http://127.0.0.1:{args.port}"
    threads = str(os.cpu_count())
    sides = {
        "ladder": ([str(ROOT / ".venv/bin/ladder"), "serve", "--model", str(args.model), "--port", str(args.port),
                    "--max-model-len", "2048", *(["--no-prefix-caching"] if args.no_prefix_caching else [])],
                   "/ready"),
        "llama.cpp": ([str(server_bin), "-m", str(args.model), "--port", str(args.port), "--reranking",
                       "-c", "8192", "-b", "2048", "-ub", "2048", "-t", threads, "-np", "4"], "/health"),
    }
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    scores: dict[str, dict[int, list[float]]] = {name: {} for name in sides}
    tokens: dict[str, set[int]] = {name: set() for name in sides}
    for round_index in range(args.rounds):
        documents = texts_of(args.documents, 500 + round_index)
        for name in (sides if round_index % 2 == 0 else reversed(list(sides))):
            command, ready = sides[name]
            proc = start(command, url, ready, logs / f"peer_rerank_{name.replace('.', '')}.log")
            try:
                model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
                rerank(url, model, texts_of(4, 99))  # warm
                took, got, prompt_tokens = rerank(url, model, documents)
            finally:
                stop(proc)
            seconds[name].append(took)
            scores[name][round_index] = got
            tokens[name].add(prompt_tokens)
            print(f"round {round_index + 1}: {name} {args.documents / took:.1f} documents/s", flush=True)
    diffs = [abs(a - b) for r in range(args.rounds) for a, b in zip(scores["ladder"][r], scores["llama.cpp"][r])]
    rank_agreement = statistics.median(spearman(scores["ladder"][r], scores["llama.cpp"][r])
                                       for r in range(args.rounds))
    rows = [{"side": name, "median_s": statistics.median(s), "rounds_s": s,
             "documents_per_s": args.documents / statistics.median(s)} for name, s in seconds.items()]
    ratio = rows[1]["median_s"] / rows[0]["median_s"]
    print(f"{args.model.name}, {args.documents} documents a round, {args.rounds} rounds alternated, {threads} threads; "
          f"prompt tokens per request ladder {sorted(tokens['ladder'])} llama.cpp {sorted(tokens['llama.cpp'])}")
    print(f"{'side':<12}{'median s':>10}{'docs/s':>9}")
    for row in rows:
        print(f"{row['side']:<12}{row['median_s']:>10.3f}{row['documents_per_s']:>9.1f}")
    print(f"ladder / llama.cpp documents/s: {ratio:.2f}x; scores: largest difference {max(diffs):.4f}, median "
          f"{statistics.median(diffs):.4f}; rank agreement (Spearman, median of rounds) {rank_agreement:.4f}")
    write_report(str(args.out), rows, model=str(args.model), documents=args.documents, ratio=ratio,
                 ladder_prefix_caching=not args.no_prefix_caching,
                 max_score_diff=max(diffs), median_score_diff=statistics.median(diffs), spearman=rank_agreement,
                 prompt_tokens={k: sorted(v) for k, v in tokens.items()}, llama_server=str(server_bin))


if __name__ == "__main__":
    main()
