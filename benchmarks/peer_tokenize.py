"""A Gemma 4 GGUF's vocabulary read as llama.cpp reads it: the same file's `/tokenize` through llama.cpp's server
and ladder's tokenizer, token for token, on texts that exercise its rules (spaces as ▁ with no prefix space,
runs of newlines split off and taken whole, <0xNN> byte tokens, control tokens in the text).

    .venv/bin/python benchmarks/peer_tokenize.py [--out benchmarks/results/peer_tokenize.json]
    .venv/bin/python benchmarks/peer_tokenize.py --pre tekken gpt-4o qwen2 llama-bpe

With `--pre`, each name is another family's splitting rules (`tokenizer.ggml.pre`) over SmolLM2's byte-level
vocabulary instead (Tekken: Mistral Nemo, Small 3.x, Devstral, Ministral 3; gpt-4o: Phi-4-mini's o200k).

The vocabulary is Gemma 3 270M's 262,144 pieces written the way llama.cpp's converter writes Gemma 4's
(`tokenizer.ggml.model` gemma4, BPE merges; tests/support/tiny_models.py `gemma4_vocab_metadata`) beside the
tiny Gemma 4 test model's weights; llama-server from `benchmarks/peer_llamacpp.sh --build-only` (cached, or
--llama-server).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import httpx
import torch
from bench_report import write_report  # benchmarks/, this script's directory
from peer_embeddings import ROOT, llama_server, start, stop

sys.path.insert(0, str(ROOT / "tests" / "support"))
from tiny_models import gemma4_vocab_metadata, hf_config, write_gguf  # the tests' model builders

import model

TEXTS = [
    "The capital of France is", "  leading spaces\nnewline\ttab ünïcödé 日本語 🙂", "a\n\nb\n\n\nc\n\n\n\n\nd",
    "def f(x):\n    return x  # two  spaces\n\n\nclass A:\n\tpass", "<start_of_turn>user\nhi<end_of_turn>\n",
    "\n\n\n\n", " ", "x \u00a0y\u2003z", "🙂🙂 \U0001F9D1\u200d\U0001F4BB \U000E0041", "1234567890 3.14159 -2e10",
    "Привет, мир! Γειά σου κόσμε. مرحبا بالعالم", "https://example.com/a?b=c&d=e#f", "trailing spaces   ",
    "ॐ मणि पद्मे हूँ ༀ་མ་ཎི", "\r\n windows \r\n\r\n line ends", "a" * 300,
    "camelCase XMLHttpRequest HTTPServer iPhone McDonald's I'M DON'T we'll", "path/to/file.py\n// comment /* x */",
]


def compare(path: Path, server_bin: Path, port: int) -> list[dict]:
    """Each text's tokens from llama.cpp's server and from ladder's tokenizer of the file at `path`."""
    ours = model.load(path).tokenizer
    url = f"http://127.0.0.1:{port}"
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "peer_tokenize.log"
    proc = start([str(server_bin), "-m", str(path), "--port", str(port), "-c", "512", "-np", "1"], url, "/health", log)
    rows = []
    try:
        for text in TEXTS:
            theirs = httpx.post(url + "/tokenize", json={"content": text, "add_special": True, "parse_special": True},
                                timeout=60).json()["tokens"]
            mine = ours.encode(text)
            rows.append({"file": path.stem, "text": text, "equal": mine == theirs, "llama_cpp": theirs, "ladder": mine})
            print(f"{path.stem:14} {mine == theirs!s:>6}  {len(mine):4} / {len(theirs):4} tokens  {text[:40]!r}",
                  flush=True)
    finally:
        stop(proc)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8978)
    parser.add_argument("--llama-server", type=Path, default=None)
    parser.add_argument("--pre", nargs="+", default=None, help="splitting rules over SmolLM2's vocabulary instead")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/peer_tokenize.json"))
    args = parser.parse_args()
    import transformers

    server_bin = llama_server(args.llama_server, "peer_tokenize")
    work = Path(tempfile.mkdtemp(prefix="ladder-peer-tokenize-"))
    torch.manual_seed(0)
    rows = []
    if args.pre:
        hf = transformers.AutoModelForCausalLM.from_config(hf_config("llama3", vocab_size=49152)).eval()
        for pre in args.pre:
            path = work / f"{pre}.gguf"
            write_gguf(hf, path, "F16", "llama", smollm2_tokenizer={"pre": pre})
            rows += compare(path, server_bin, args.port)
    else:
        vocab = gemma4_vocab_metadata()
        cfg = hf_config("gemma4", vocab_size=len(vocab["tokenizer.ggml.tokens"]))
        path = work / "gemma4-vocab.gguf"
        write_gguf(transformers.AutoModelForCausalLM.from_config(cfg).eval(), path, "F16", "gemma4", vocab=vocab)
        rows += compare(path, server_bin, args.port)
    equal = sum(r["equal"] for r in rows)
    print(f"{equal} of {len(rows)} texts tokenized alike")
    write_report(str(args.out), rows, texts_equal=equal, texts=len(rows), llama_server=str(server_bin))


if __name__ == "__main__":
    main()
