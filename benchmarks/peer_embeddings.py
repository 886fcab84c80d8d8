"""Embeddings from `ladder serve` against llama.cpp's server on the same GGUF file, one server at a time on the
same cores, the same texts through OpenAI's /v1/embeddings, alternated; and how close their vectors are.

    .venv/bin/python benchmarks/peer_embeddings.py [--model GGUF] [--texts 256] [--batch 16] [--users 1,4]
        [--rounds 2] [--out benchmarks/results/peer_embeddings.json] [-- ladder serve args]

llama-server comes from `benchmarks/peer_llamacpp.sh --build-only` (cached in $LADDER_PEER_CACHE, default
~/.cache/ladder/peer-llamacpp; or --llama-server) and runs with `--embeddings --pooling last` (the last
token's hidden state, L2-normalized: ladder's rule for a model that declares none), its batch as large as its
context so every text fits one batch. ladder runs its CPU default for the file (`--quantization auto`). Texts
are sentences of 8-120 random words, new ones for each load (the same for both servers); each request sends
--batch of them; --users clients send requests one after another.
The table gives texts/s (the median of the rounds) and the per-request latency p50; "cosine" is the smallest
cosine similarity between the two servers' vectors of the same text (1.0: the same direction).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from bench_report import write_report  # benchmarks/, this script's directory

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the", "sea", "river", "mountain", "cloud", "city", "market", "music", "history", "science", "language",
         "garden", "winter", "summer", "light", "engine", "road", "bridge", "forest", "letter", "window",
         "morning", "evening", "story", "number", "table", "kitchen", "doctor", "teacher", "company", "report",
         "system", "network", "energy", "planet", "animal", "flower", "money", "travel", "memory", "water",
         "stone")


def texts_of(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 120))).capitalize() + "." for _ in range(count)]


def llama_server(given: Path | None, script: str) -> Path:
    """The llama-server binary: `given`, else the first one peer_llamacpp.sh built (its cache); exits with the
    way to build one when there is none."""
    cache = Path(os.environ.get("LADDER_PEER_CACHE", Path.home() / ".cache/ladder/peer-llamacpp"))
    found = given or next(iter(sorted(cache.glob("*/llama-server"))), None)
    if found is None:
        sys.exit(f"{script}: no llama-server under {cache}; run benchmarks/peer_llamacpp.sh --build-only")
    return found


def start(command: list[str], url: str, ready_path: str, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{command[0]} exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(url + ready_path, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{command[0]} was not ready within 600 s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


async def run_load(url: str, model: str, texts: list[str], batch: int, users: int) -> tuple[float, list[float], dict]:
    """(seconds, per-request latencies, text -> vector) for every text sent once, `users` clients at a time."""
    batches = [texts[i:i + batch] for i in range(0, len(texts), batch)]
    vectors: dict[str, np.ndarray] = {}
    latencies: list[float] = []
    queue = list(enumerate(batches))

    async def client(http: httpx.AsyncClient) -> None:
        while queue:
            _, inputs = queue.pop(0)
            sent = time.perf_counter()
            response = await http.post(url + "/v1/embeddings", json={"model": model, "input": inputs,
                                                                     "encoding_format": "float"})
            latencies.append(time.perf_counter() - sent)
            response.raise_for_status()
            for text, item in zip(inputs, sorted(response.json()["data"], key=lambda d: d["index"]), strict=True):
                vectors[text] = np.asarray(item["embedding"], dtype=np.float64)

    async with httpx.AsyncClient(timeout=600) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(users)))
        return time.perf_counter() - started, latencies, vectors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the embedded model's)")
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16, help="texts per request")
    parser.add_argument("--users", default="1,4", help="concurrent clients, a comma-separated list")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8191)
    parser.add_argument("--llama-server", type=Path, default=None,
                        help="the llama-server binary (default: the first one peer_llamacpp.sh built)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/peer_embeddings.json"))
    args, ladder_args = parser.parse_known_args()
    ladder_args = [a for a in ladder_args if a != "--"]
    users = [int(u) for u in args.users.split(",")]
    if min(args.texts, args.batch, args.rounds, *users) < 1:
        parser.error("--texts, --batch, --rounds and --users must be at least 1")
    from model.default import default_model_path

    gguf = Path(args.model) if args.model else default_model_path()
    server_bin = llama_server(args.llama_server, "peer_embeddings")
    url = f"http://127.0.0.1:{args.port}"
    threads = str(os.cpu_count())
    sides = {
        "ladder": ([str(ROOT / ".venv/bin/ladder"), "serve", "--model", str(gguf), "--port", str(args.port),
                    "--max-model-len", "2048", *ladder_args], "/ready"),
        "llama.cpp": ([str(server_bin), "-m", str(gguf), "--port", str(args.port), "--embeddings", "--pooling",
                       "last", "-c", "2048", "-b", "2048", "-ub", "2048", "-t", threads, "-np", str(max(users))],
                      "/health"),
    }
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    seconds: dict[tuple[str, int], list[float]] = {}
    latencies: dict[tuple[str, int], list[float]] = {}
    vectors: dict[str, dict] = {}
    for round_index in range(args.rounds):
        order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
        for name in order:
            command, ready = sides[name]
            proc = start(command, url, ready, logs / f"peer_embeddings_{name.replace('.', '')}.log")
            try:
                model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
                asyncio.run(run_load(url, model, texts_of(args.batch, -1), args.batch, 1))  # warm
                for count in users:
                    # Texts of their own for each load (both servers get the same): a text sent again would
                    # be read from ladder's prefix cache, which a benchmark of fresh texts must not measure.
                    texts = texts_of(args.texts, 1000 * round_index + count)
                    took, lat, vecs = asyncio.run(run_load(url, model, texts, args.batch, count))
                    seconds.setdefault((name, count), []).append(took)
                    latencies.setdefault((name, count), []).extend(lat)
                    vectors.setdefault(name, {}).update(vecs)
                    print(f"round {round_index + 1}: {name}, {count} users: {args.texts / took:.1f} texts/s",
                          flush=True)
            finally:
                stop(proc)
    cosines = [float(vectors["ladder"][t] @ vectors["llama.cpp"][t]
                     / np.linalg.norm(vectors["ladder"][t]) / np.linalg.norm(vectors["llama.cpp"][t]))
               for t in vectors["ladder"]]
    rows = []
    for count in users:
        row = {"users": count}
        for name in sides:
            row[f"{name} texts/s"] = args.texts / statistics.median(seconds[(name, count)])
            row[f"{name} p50 ms"] = 1000 * statistics.median(latencies[(name, count)])
            row[f"{name} rounds_s"] = seconds[(name, count)]
        row["ratio"] = row["ladder texts/s"] / row["llama.cpp texts/s"]
        rows.append(row)
    print(f"{gguf.name}, {args.texts} texts of 8-120 words, {args.batch} a request, {args.rounds} rounds alternated, "
          f"{threads} threads; smallest cosine between the servers' vectors {min(cosines):.4f} (median "
          f"{statistics.median(cosines):.4f})")
    print(f"{'users':>5}{'ladder texts/s':>16}{'llama.cpp texts/s':>19}{'ratio':>8}{'p50 ms ladder / llama.cpp':>28}")
    for row in rows:
        print(f"{row['users']:>5}{row['ladder texts/s']:>16.1f}{row['llama.cpp texts/s']:>19.1f}{row['ratio']:>7.2f}x"
              f"{row['ladder p50 ms']:>15.0f} / {row['llama.cpp p50 ms']:.0f}")
    write_report(str(args.out), rows, model=str(gguf), texts=args.texts, batch=args.batch,
                 min_cosine=min(cosines), median_cosine=statistics.median(cosines), llama_server=str(server_bin))


if __name__ == "__main__":
    main()
