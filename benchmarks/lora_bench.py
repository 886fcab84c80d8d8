"""Multi-LoRA serving on the default model: throughput with adapters against the base model in one run,
and the quality cost of a quantized base under a float LoRA.

1. Throughput: `ladder bench`'s engine run (engine/throughput.py), the same prompts once with the base
   model and once spread round-robin over N adapters (request i with adapter i mod N), closed loop with
   every request in at once, greedy, exact output lengths. Reported: output tok/s of each, and their ratio;
   then the same prompts on an engine without adapters (a server started without `--lora-modules`), to
   which both are compared.
2. Quality: perplexity of the built-in text (model/perplexity.py) under one adapter, on the float32 base
   and on the quantized base (W4A8 of the GGUF's own blocks, the CPU default), beside the same pair
   without the adapter: the quantized base's cost with and without LoRA.

The adapters are random, written in PEFT's layout (adapter_config.json + adapter_model.safetensors) with
A ~ N(0, 1/in) and B ~ N(0, scale^2 / rank), which moves the model's outputs without wrecking it; the
throughput depends on their shapes only.

    .venv/bin/python benchmarks/lora_bench.py --adapters 8 --rank 16 --num-prompts 32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.throughput import BenchConfig, format_table, run_bench
from model.config import ModelConfig
from model.lora import TARGETS, target_shape


def write_random_adapter(config: ModelConfig, path: Path, rank: int, seed: int, scale: float = 0.1) -> Path:
    """A random PEFT adapter of `rank` on every projection of every layer."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for target in TARGETS:
            out_features, in_features = target_shape(config, target)
            block = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * scale / rank**0.5
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(TARGETS), "bias": "none"}))
    save_file(tensors, path / "adapter_model.safetensors")
    return path


def quality(adapter: Path, text_tokens: int) -> dict:
    """Perplexity with and without the adapter, on the float32 and the W4A8 base."""
    import model
    from model.lora import load_adapter
    from model.lora_slots import LoRASlots
    from model.perplexity import corpus_text, perplexity

    rows = {}
    for scheme in ("none", "w4a8"):
        loaded = model.load(quantization=scheme)
        ids = loaded.tokenizer.encode(corpus_text())[:text_tokens]
        base = perplexity(loaded.module, ids)
        LoRASlots.with_one(loaded.module, load_adapter(adapter, loaded.config))
        rows["float32" if scheme == "none" else scheme] = {"base": base, "lora": perplexity(loaded.module, ids)}
    ref = rows["float32"]
    for row in rows.values():
        row["base_vs_float32"] = row["base"] / ref["base"] - 1
        row["lora_vs_float32"] = row["lora"] / ref["lora"] - 1
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--quality-tokens", type=int, default=1024, help="0 skips the perplexity part")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lora_bench.json"))
    args = parser.parse_args()

    import model

    config = model.load().config
    with tempfile.TemporaryDirectory() as tmp:
        paths = [write_random_adapter(config, Path(tmp) / f"lora{i}", args.rank, seed=i) for i in range(args.adapters)]
        bench = BenchConfig(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                            max_num_seqs=args.num_prompts, skip_hf=True, quantization=args.quantization,
                            lora_modules=tuple((p.name, str(p)) for p in paths), max_loras=args.adapters,
                            max_lora_rank=args.rank)
        report = run_bench(bench)
        print(format_table(report))
        plain = run_bench(dataclasses.replace(bench, lora_modules=()))["results"]["ladder"]["output_tokens_per_s"]
        with_slots = report["results"]
        report["without_adapters_tokens_per_s"] = plain
        print(f"an engine without adapters: {plain:.1f} output tok/s; with {args.adapters} resident, base-model "
              f"requests {with_slots['ladder']['output_tokens_per_s'] / plain:.2f}x that, requests with adapters "
              f"{with_slots['ladder+lora']['output_tokens_per_s'] / plain:.2f}x")
        quality_rows = quality(paths[0], args.quality_tokens) if args.quality_tokens else {}
    if quality_rows:
        print(f"\nperplexity of {args.quality_tokens} tokens of the built-in text, adapter lora0 (rank {args.rank})")
        print(f"{'base weights':<14}{'base':>10}{'+ LoRA':>10}{'base vs fp32':>15}{'LoRA vs fp32':>15}")
        for name, row in quality_rows.items():
            print(f"{name:<14}{row['base']:>10.3f}{row['lora']:>10.3f}{row['base_vs_float32']:>+15.2%}"
                  f"{row['lora_vs_float32']:>+15.2%}")
    result = {"throughput": report, "quality": quality_rows, "adapters": args.adapters, "rank": args.rank,
              "cpu": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
