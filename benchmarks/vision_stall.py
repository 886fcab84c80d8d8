"""What an image costs the requests already running: `ladder serve` with its vision tower run a tile between
engine steps (`--vision-tiles-per-step 1`, the default) against each image whole (`0`), in one run.

    .venv/bin/python benchmarks/vision_stall.py [--rounds 2] [--out benchmarks/results/vision_stall.json]

The model is benchmarks/peer_vision.py's (SmolVLM-256M's shapes, a Q8_0 text GGUF and its projector, random
weights). Each round streams one text reply (400 tokens, EOS ignored) and, once its tokens flow, sends a chat
with one new 800x600 image (5 tiles at a longest edge of 1024). The table gives the text stream's longest gap
between two tokens while the image was in (from its request to its first token) and the image's time to its
first token; medians of the rounds, one server at a time, the two settings alternated.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import threading
import time
from pathlib import Path

import httpx
from bench_report import write_report  # benchmarks/, this script's directory
from peer_embeddings import ROOT, start, stop
from peer_vision import chat, write_files
from vision_bench import image_bytes


def stream_text(url: str, model: str, stamps: list[float], started: threading.Event) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 400,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and any(c.get("delta", {}).get("content")
                                                  for c in json.loads(line[6:]).get("choices") or ()):
                stamps.append(time.perf_counter())
                started.set()


def round_of(url: str, data: bytes) -> dict[str, float]:
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    chat(url, model, image_bytes(999, 600, 800)[0], 4)  # warm
    stamps: list[float] = []
    started = threading.Event()
    text = threading.Thread(target=stream_text, args=(url, model, stamps, started))
    text.start()
    started.wait(120)
    time.sleep(0.5)  # the stream in its stride
    sent = time.perf_counter()
    image = chat(url, model, data, 8)
    first = sent + image["ttft_ms"] / 1e3
    text.join()
    gaps = list(itertools.pairwise(stamps))
    during = [b - a for a, b in gaps if b >= sent and a <= first]
    before = [b - a for a, b in gaps if b < sent]
    return {"max_gap_ms": 1e3 * max(during), "text_tpot_ms": 1e3 * statistics.median(before),
            "image_ttft_ms": image["ttft_ms"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8196)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/vision_stall.json"))
    args = parser.parse_args()
    text, mmproj = write_files(1024, "Q8_0")
    url = f"http://127.0.0.1:{args.port}"
    sides = {f"tiles per step {n}": [str(ROOT / ".venv/bin/ladder"), "serve", "--model", str(text), "--mmproj",
                                     str(mmproj), "--port", str(args.port), "--max-model-len", "4096",
                                     "--vision-tiles-per-step", str(n)] for n in (1, 0)}
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    results: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for r in range(args.rounds):
        data, _ = image_bytes(200 + r, 600, 800)
        for name in (list(sides) if r % 2 == 0 else list(reversed(sides))):
            proc = start(sides[name], url, "/ready", logs / "vision_stall.log")
            try:
                row = round_of(url, data)
            finally:
                stop(proc)
            results[name].append(row)
            print(f"round {r + 1}: {name}: text's longest gap {row['max_gap_ms']:.0f} ms (its TPOT "
                  f"{row['text_tpot_ms']:.1f} ms), image TTFT {row['image_ttft_ms']:.0f} ms", flush=True)
    rows = [{"side": name, **{k: statistics.median(r[k] for r in runs) for k in runs[0]}, "rounds": runs}
            for name, runs in results.items()]
    print(f"{'side':<20}{'text longest gap ms':>21}{'text TPOT ms':>14}{'image TTFT ms':>15}")
    for row in rows:
        print(f"{row['side']:<20}{row['max_gap_ms']:>21.0f}{row['text_tpot_ms']:>14.1f}{row['image_ttft_ms']:>15.0f}")
    write_report(str(args.out), rows, model=str(text), mmproj=str(mmproj))


if __name__ == "__main__":
    main()
