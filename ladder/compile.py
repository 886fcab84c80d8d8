"""`ladder compile`: turn a model into a verified artifact directory (see compile/pipeline.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.backends.manifest import BACKENDS
from engine.config import resolve_device
from model.precision import COMPILE_PRECISIONS


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("compile", help="compile a model into a verified artifact directory",
                            description="Export a model through torch.compile, ONNX or TensorRT in a given "
                                        "precision, check it against fp32 eager, benchmark it, and write an "
                                        "artifact directory with a manifest.")
    p.add_argument("--model", default=None, help="HF directory or GGUF file (default: the embedded model)")
    p.add_argument("--backend", required=True, choices=BACKENDS)
    p.add_argument("--precision", default="fp32", choices=COMPILE_PRECISIONS)
    p.add_argument("--out", type=Path, required=True, help="the artifact directory to create (must not exist)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"],
                   help="where the artifact will run: cpu, cuda, or auto (cuda when present)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="most sequences per step the artifact serves")
    p.add_argument("--max-model-len", type=int, default=2048, help="longest sequence the artifact serves")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="most tokens per step the artifact serves (the TensorRT engine is built for it)")
    p.add_argument("--bench-batch", type=int, default=32, help="batch size of the batched decode benchmark")
    p.add_argument("--no-bench", action="store_true", help="skip the benchmark stage")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from compile.pipeline import CompileOptions
    from compile.pipeline import run as compile_model

    options = CompileOptions(
        model=args.model, backend=args.backend, precision=args.precision, out=args.out,
        device=resolve_device(args.device),
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens, bench_batch=args.bench_batch,
        run_bench=not args.no_bench,
    )
    compile_model(options)
    return 0
