"""Images: `ladder serve` against llama.cpp's server on the same files, a text GGUF and its `--mmproj`
projector, one server at a time on the same cores, the same chats with one image each through OpenAI's
/v1/chat/completions, streamed; alternated round by round.

    .venv/bin/python benchmarks/peer_vision.py [--family smolvlm|gemma3] [--longest-edge 1024] [--rounds 4]
        [--max-tokens 32] [--text-type Q8_0] [--vision-layers 8] [--out benchmarks/results/peer_vision.json]

The files hold random weights, written as llama.cpp's converter writes the family (tests/support/tiny_models.py
`write_vision_gguf`, `write_gemma3_vision_gguf`): the text model in --text-type (Q8_0, as llama.cpp's SmolVLM
files ship). smolvlm: SmolVLM-256M-Instruct's shapes (benchmarks/vision_bench.py's), the projector in
float16 with float32 embeddings. gemma3: benchmarks/gemma3_vision_bench.py's shapes (Gemma 3 1B's decoder,
Gemma 3's SigLIP over 896 pixels with --vision-layers of its 27 layers), the projector in float32 with its
projection in float16 (the converter's `--outtype f32`), one 256-token image a chat.
llama-server comes from `benchmarks/peer_llamacpp.sh --build-only` (cached, or --llama-server) and runs with
`--mmproj`, all cores. ladder runs its CPU default (`--quantization auto`: W8A8 for a file of 8-bit codes;
`--vision-dtype auto`: a bfloat16 tower on a CPU with bfloat16 matmuls in hardware), and again with a float32
tower (`--vision-dtype float32`). Each round sends one new 800x600 JPEG (resized by both to --longest-edge first: 5
tiles at 1024) and the same question, greedy, --max-tokens tokens with EOS ignored, after a warm-up chat with
another image. TTFT is from the request to the first content token; decode the tokens after it per second.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from bench_report import write_report  # benchmarks/, this script's directory
from peer_embeddings import ROOT, llama_server, start, stop
from vision_bench import TEXT, VISION, image_bytes

sys.path.insert(0, str(ROOT / "tests" / "support"))
from tiny_models import make_tiny_vision_model, write_vision_gguf  # the tests' model builders, at full size

QUESTION = "Describe this image in detail."


def write_files(family: str, longest_edge: int, text_type: str, vision_layers: int) -> tuple[Path, Path]:
    """The family's random weights as llama.cpp's files: (text GGUF, projector GGUF), in a new temp dir."""
    work = Path(tempfile.mkdtemp(prefix="ladder-peer-vision-"))
    if family == "gemma3":
        from gemma3_vision_bench import build
        from tiny_models import write_gemma3_vision_gguf

        text, mmproj = work / f"text-{text_type}.gguf", work / "mmproj.gguf"
        write_gemma3_vision_gguf(build(work / "gemma3", vision_layers), text, mmproj, text_type)
        return text, mmproj
    directory = make_tiny_vision_model(work / "smolvlm-256m-shapes", longest_edge=longest_edge, tile=512,
                                       text=TEXT, vision=VISION, scale_factor=4)
    text, mmproj = work / f"text-{text_type}.gguf", work / "mmproj-f16.gguf"
    write_vision_gguf(directory, text, mmproj, text_type, mmproj_f16=True)
    return text, mmproj


def chat(url: str, model: str, data: bytes, max_tokens: int) -> dict[str, float]:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(data).decode()}},
                {"type": "text", "text": QUESTION}]}]}
    start_at = time.perf_counter()
    first = None
    pieces = 0
    usage: dict = {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for choice in event.get("choices") or ():
                if choice.get("delta", {}).get("content"):
                    pieces += 1
                    first = first or time.perf_counter()
    end = time.perf_counter()
    tokens = usage.get("completion_tokens", pieces)
    return {"ttft_ms": 1e3 * (first - start_at), "decode_tok_s": (tokens - 1) / (end - first),
            "prompt_tokens": usage.get("prompt_tokens", 0), "completion_tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=("smolvlm", "gemma3"), default="smolvlm")
    parser.add_argument("--longest-edge", type=int, default=1024, help="smolvlm's resize")
    parser.add_argument("--vision-layers", type=int, default=8, help="gemma3's, of its tower's 27")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--text-type", default="Q8_0")
    parser.add_argument("--port", type=int, default=8194)
    parser.add_argument("--llama-server", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/peer_vision.json"))
    args = parser.parse_args()
    server_bin = llama_server(args.llama_server, "peer_vision")
    text, mmproj = write_files(args.family, args.longest_edge, args.text_type, args.vision_layers)
    url = f"http://127.0.0.1:{args.port}"
    threads = str(os.cpu_count())
    ladder = [str(ROOT / ".venv/bin/ladder"), "serve", "--model", str(text), "--mmproj", str(mmproj),
              "--port", str(args.port), "--max-model-len", "4096"]
    sides = {
        "ladder": (ladder, "/ready"),
        "ladder fp32 tower": ([*ladder, "--vision-dtype", "float32"], "/ready"),
        "llama.cpp": ([str(server_bin), "-m", str(text), "--mmproj", str(mmproj), "--port", str(args.port),
                       "-c", "4096", "-t", threads, "-np", "1"], "/health"),
    }
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    results: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for round_index in range(args.rounds):
        data, _ = image_bytes(100 + round_index, 600, 800)
        for name in (list(sides) if round_index % 2 == 0 else list(reversed(sides))):
            command, ready = sides[name]
            proc = start(command, url, ready, logs / f"peer_vision_{name.replace('.', '').replace(' ', '_')}.log")
            try:
                model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
                chat(url, model, image_bytes(999, 600, 800)[0], 4)  # warm
                row = chat(url, model, data, args.max_tokens)
            finally:
                stop(proc)
            results[name].append(row)
            print(f"round {round_index + 1}: {name} TTFT {row['ttft_ms']:.0f} ms, decode {row['decode_tok_s']:.1f} "
                  f"tok/s, prompt {row['prompt_tokens']} tokens", flush=True)
    rows = [{"side": name, **{k: statistics.median(r[k] for r in runs) for k in runs[0]},
             "rounds": runs} for name, runs in results.items()]
    ladder, _, peer = rows
    shape = f"longest edge {args.longest_edge}" if args.family == "smolvlm" else f"{args.vision_layers} tower layers"
    print(f"{args.family}: {text.name} + {mmproj.name}, {shape}, {args.rounds} rounds alternated, {threads} threads")
    print(f"{'side':<20}{'TTFT ms':>10}{'vs llama.cpp':>14}{'decode tok/s':>14}{'prompt tokens':>15}")
    for row in rows:
        print(f"{row['side']:<20}{row['ttft_ms']:>10.0f}{peer['ttft_ms'] / row['ttft_ms']:>13.2f}x"
              f"{row['decode_tok_s']:>14.1f}{row['prompt_tokens']:>15.0f}")
    print(f"ladder vs llama.cpp: TTFT {peer['ttft_ms'] / ladder['ttft_ms']:.2f}x faster, decode "
          f"{ladder['decode_tok_s'] / peer['decode_tok_s']:.2f}x")
    write_report(str(args.out), rows, family=args.family, longest_edge=args.longest_edge,
                 vision_layers=args.vision_layers if args.family == "gemma3" else None, text_type=args.text_type,
                 max_tokens=args.max_tokens, ttft_ratio=peer["ttft_ms"] / ladder["ttft_ms"],
                 decode_ratio=ladder["decode_tok_s"] / peer["decode_tok_s"], llama_server=str(server_bin))


if __name__ == "__main__":
    main()
