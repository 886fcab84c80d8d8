"""`ladder bench`: offline throughput of the engine against transformers `generate`, one table."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.throughput import BenchConfig, format_table, run_bench, write_report
from ladder.device import add_device_argument
from ladder.lora import add_lora_arguments, lora_config
from ladder.precision import (
    add_auto_dtype_argument,
    add_dtype_argument,
    add_kv_cache_dtype_argument,
    add_quantization_argument,
)
from ladder.tensor_parallel import add_tensor_parallel_argument


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("bench", help="offline throughput benchmark against transformers",
                            description="Run N random prompts through the engine and through transformers "
                                        "generate on the same weights; print one table and write JSON.")
    p.add_argument("--model", default=None, help="HF directory or GGUF file (default: the embedded model)")
    p.add_argument("--artifact", default=None,
                   help="a `ladder compile` artifact to run instead (transformers runs its source in fp32)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0, help="spread lengths by +/- this fraction")
    p.add_argument("--seed", type=int, default=0)
    add_auto_dtype_argument(p)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="prompt tokens per step while other requests decode, so their streams keep flowing "
                        "(default: no bound, the whole --max-num-batched-tokens)")
    p.add_argument("--kv-cache-memory", type=float, default=None, help="GiB for the KV cache")
    add_kv_cache_dtype_argument(p)
    p.add_argument("--hf-batch-size", type=int, default=64, help="batch size of transformers generate")
    add_dtype_argument(p, "--hf-dtype", default=None,
                       help="dtype of transformers (default: the engine's --dtype; float32 for an artifact)")
    p.add_argument("--skip-hf", action="store_true", help="run the engine alone")
    add_device_argument(p)
    add_quantization_argument(p)
    add_tensor_parallel_argument(p)
    add_lora_arguments(p)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/bench.json"), help="JSON report path")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = BenchConfig(
        model=args.model, artifact=args.artifact, num_prompts=args.num_prompts, input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio, seed=args.seed, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_prefill_tokens=args.max_prefill_tokens,
        kv_cache_memory_gib=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype,
        hf_batch_size=args.hf_batch_size, skip_hf=args.skip_hf, hf_dtype=args.hf_dtype, device=args.device,
        quantization=args.quantization, tensor_parallel_size=args.tensor_parallel_size,
        tensor_parallel_attention=args.tensor_parallel_attention,
        **{k: v for k, v in lora_config(args).items() if k != "enable_lora"},
    )
    report = run_bench(config)
    print(format_table(report))
    write_report(report, args.out)
    print(f"wrote {args.out}")
    return 0
