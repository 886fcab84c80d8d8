"""`--lora-modules name=path ...`, `--enable-lora`, `--max-loras` and `--max-lora-rank`, shared by serve and
bench."""

from __future__ import annotations

import argparse


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                        help="LoRA adapters served beside the model, each a PEFT directory (adapter_config.json + "
                             "adapter_model.safetensors) or a GGUF adapter; a request picks one by its `model` field")
    parser.add_argument("--enable-lora", action="store_true",
                        help="make LoRA slots even with no --lora-modules, for adapters loaded at run time "
                             "(POST /v1/load_lora_adapter)")
    parser.add_argument("--max-loras", type=int, default=4,
                        help="adapters resident at once; others wait in host memory and are swapped in as "
                             "requests need them (default 4)")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank (default 16)")


def lora_config(args: argparse.Namespace) -> dict:
    """The EngineConfig fields of the parsed LoRA arguments; ValueError (one line) for a malformed pair."""
    modules = []
    for item in args.lora_modules:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules takes NAME=PATH pairs, got {item!r}")
        modules.append((name.strip(), path.strip()))
    return {"lora_modules": tuple(modules), "enable_lora": args.enable_lora, "max_loras": args.max_loras,
            "max_lora_rank": args.max_lora_rank}
