"""GGUF files read as llama.cpp reads them: the same random-weight file of each family through llama.cpp's server
and ladder, the next token's top-5 log-probabilities after one prompt compared. A check of how ladder reads a
family's GGUF metadata and tensors (llama.cpp's names, permutations, rotations), beside the tests' parity with
transformers on the same weights.

    .venv/bin/python benchmarks/peer_logprobs.py [--families smollm3 phi3 ...] [--context 512] [--quantization w4a8]
        [--out benchmarks/results/peer_logprobs.json]

Each family's tiny test model (tests/support/tiny_models.py) at width 256 with SmolLM2's 49k vocabulary (llama.cpp
needs a real tokenizer), written as F32 by `write_gguf`; llama-server from `benchmarks/peer_llamacpp.sh
--build-only` (cached, or --llama-server) with `-c --context`, ladder with `max_model_len` the same (both then
take LongRoPE's long factors past a model's original context). llama.cpp keeps its KV cache in float16, so
differences of about 0.01 are its rounding.
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
from tiny_models import (  # the tests' model builders
    hf_config,
    ministral3_config,
    spread_qwen3_5_parameters,
    write_gguf,
    write_gpt_oss_gguf,
    write_qwen35_gguf,
)

import model
from model.generator import Generator

ARCHES = {"llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3", "gemma4": "gemma4",
          "gemma4_e": "gemma4", "gemma4_moe": "gemma4", "smollm3": "smollm3", "phi3": "phi3",
          "qwen3_yarn": "qwen3", "llama3_yarn": "llama", "ministral3": "mistral3", "gpt_oss": "gpt-oss",
          "qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next"}
LINEAR_ATTENTION = ("qwen3_5", "qwen3_5_moe", "qwen3_next")  # written by write_qwen35_gguf
# *_yarn: the family with YaRN (factor 4 over an original context of 32: every pair's frequency it changes
# matters within the 40-token prompt), as Qwen 3 configs ask for past 32k tokens.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


def write_file(family: str, directory: Path) -> Path:
    import transformers

    if family.startswith("gemma4"):  # heads of 64 and (full attention) 128 dims; per-layer embeddings of 64
        sizes = {"gemma4_e": {"hidden_size_per_layer_input": 64}, "gemma4_moe": {"moe_intermediate_size": 128}}
        cfg = hf_config(family, vocab_size=49152, hidden_size=256, intermediate_size=512, head_dim=64,
                        global_head_dim=128, **sizes.get(family, {}))
    elif family == "ministral3":  # YaRN and the attention temperature past 64 tokens (the prompt has 40)
        cfg = ministral3_config(vocab_size=49152, original_context=64)
        cfg.hidden_size, cfg.intermediate_size = 256, 512
    else:
        cfg = hf_config(family.removesuffix("_yarn"), vocab_size=49152)
        cfg.hidden_size, cfg.intermediate_size = 256, 512
    if family.endswith("_yarn"):
        cfg.rope_parameters = {**YARN, "rope_theta": cfg.rope_parameters["rope_theta"]}
    if family == "gemma3":  # llama.cpp scales Gemma 3's queries by head_dim
        cfg.query_pre_attn_scalar = cfg.head_dim
    if family in LINEAR_ATTENTION:  # llama.cpp's linear attention has value heads as wide as its key heads
        cfg.linear_key_head_dim = cfg.linear_value_head_dim = 32
    if family == "qwen3_next":  # llama.cpp's qwen3next takes every layer sparse
        cfg.mlp_only_layers = []
    if family == "phi3":  # 3/4 of a 64-dim head rotates: 24 LongRoPE factors
        cfg.rope_parameters = {**cfg.rope_parameters, "short_factor": [1.0 + k / 24 for k in range(24)],
                               "long_factor": [2.0 + k / 12 for k in range(24)]}
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    path = directory / f"{family}.gguf"
    if family == "gpt_oss":  # its sinks and biases away from 0, its experts MXFP4 as the published files hold them
        with torch.no_grad():
            for name, param in hf.named_parameters():
                if name.endswith(("bias", "sinks")):
                    param.normal_(0, 0.5)
        write_gpt_oss_gguf(hf, path, "F32", "MXFP4", smollm2_tokenizer=True)
        return path
    if family in LINEAR_ATTENTION:
        write_qwen35_gguf(spread_qwen3_5_parameters(hf), path, "F32", smollm2_tokenizer=True)
        return path
    write_gguf(hf, path, "F32", ARCHES[family], smollm2_tokenizer=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=list(ARCHES), choices=list(ARCHES))
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--quantization", default="none",
                        help="ladder's side: none (the file's weights dequantized) or w4a8 (its blocks, activations "
                             "in int8 per 32, as llama.cpp's CPU matmuls take them)")
    parser.add_argument("--port", type=int, default=8977)
    parser.add_argument("--llama-server", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/peer_logprobs.json"))
    args = parser.parse_args()
    server_bin = llama_server(args.llama_server, "peer_logprobs")
    work = Path(tempfile.mkdtemp(prefix="ladder-peer-logprobs-"))
    url = f"http://127.0.0.1:{args.port}"
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    rows = []
    print(f"{'family':10} {'top-5 ids equal':>16} {'max |d logprob|':>16}")
    for family in args.families:
        path = write_file(family, work)
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"peer_logprobs_{family}.log"
        proc = start([str(server_bin), "-m", str(path), "--port", str(args.port), "-c", str(args.context),
                      "-t", str(os.cpu_count()), "-np", "1"], url, "/health", log)
        try:
            reply = httpx.post(url + "/completion", json={"prompt": ids, "n_predict": 1, "n_probs": 5,
                                                          "temperature": 0}, timeout=60).json()
        finally:
            stop(proc)
        top = reply["completion_probabilities"][0]["top_logprobs"]
        loaded = model.load(path, quantization=args.quantization)
        ours = torch.log_softmax(Generator(loaded.module, args.context).step(ids)[-1].float(), -1)
        same = [t["id"] for t in top] == torch.topk(ours, len(top)).indices.tolist()
        worst = max(abs(ours[t["id"]].item() - t["logprob"]) for t in top)
        rows.append({"family": family, "arch": ARCHES[family], "top_ids_equal": same, "max_logprob_diff": worst})
        print(f"{family:10} {str(same):>16} {worst:16.4f}", flush=True)
    write_report(str(args.out), rows, context=args.context, prompt_tokens=len(ids), llama_server=str(server_bin),
                 quantization=args.quantization)


if __name__ == "__main__":
    main()
