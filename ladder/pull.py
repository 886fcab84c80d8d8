"""`ladder pull org/name`: fetch a model by name into the Hugging Face hub cache (model/hub.py), and the
`--revision` and `--download-dir` flags that serve and generate share for a model by name."""

from __future__ import annotations

import argparse


def add_hub_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--revision", default=None,
                        help="for a model by name (org/name): the hub branch, tag or commit (default main)")
    parser.add_argument("--download-dir", default=None, metavar="DIR",
                        help="for a model by name: the hub cache to use (default $HF_HUB_CACHE, or $HF_HOME/hub); "
                             "with HF_HUB_OFFLINE=1 nothing is downloaded")


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "pull", help="download a model by name from the Hugging Face hub into its cache",
        description="Download org/name (config, tokenizer, safetensors and generation_config.json; or one GGUF "
                    "file, org/name:file.gguf) into the hub cache, so `ladder serve --model org/name` starts "
                    "without the network (HF_HUB_OFFLINE=1). Prints the local path.")
    p.add_argument("name", help="org/name or org/name:file.gguf")
    add_hub_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from model.hub import fetch

    print(fetch(args.name, args.revision, args.download_dir))
    return 0
