"""`ladder doctor`: which layer bounds this model on this machine, with a roofline plot and JSON."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ladder.precision import add_dtype_argument, add_kv_cache_dtype_argument, add_quantization_argument


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "doctor", help="the five-layer bottleneck report: model, parallelism, runtime, compile, hardware",
        description="Measure this machine's limits (memory bandwidth, matmul throughput per precision), the "
                    "model's bytes and FLOPs per step, decode and prefill sweeps and a short load through the "
                    "engine, and one batch-1 decode step taken apart op by op; print the report layer by layer "
                    "and the verdict (memory, compute, queue, communication or Python overhead bound), and write "
                    "a roofline PNG and JSON. --quantization takes `ladder serve`'s choices and default, so "
                    "the doctor examines the linears serve runs.")
    source = p.add_argument_group("what to examine (default: the embedded model, loaded here)")
    source.add_argument("--model", default=None, help="HF directory or GGUF file")
    source.add_argument("--artifact", default=None, help="a `ladder compile` artifact directory")
    source.add_argument("--base-url", default=None, help="a running ladder server (reads /metrics and /stats)")
    source.add_argument("--api-key", default=os.environ.get("LADDER_API_KEY"),
                        help="the server's key, for --base-url (default: $LADDER_API_KEY)")
    engine = p.add_argument_group("engine and workload")
    add_dtype_argument(engine)
    add_quantization_argument(engine)
    add_kv_cache_dtype_argument(engine)
    engine.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when present")
    engine.add_argument("--max-num-seqs", type=int, default=16, help="sequence cap; the decode sweep goes up to it")
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--input-len", type=int, default=64, help="prompt tokens of the load (default 64)")
    engine.add_argument("--output-len", type=int, default=16, help="output tokens of the load (default 16)")
    engine.add_argument("--num-requests", type=int, default=None,
                        help="requests of the load, all sent at once (default: --max-num-seqs)")
    engine.add_argument("--max-prefill", type=int, default=256, help="largest prefill of the sweep (default 256)")
    engine.add_argument("--no-prefix-caching", action="store_true")
    engine.add_argument("--threads", type=int, default=None, help="torch threads on the CPU (default: torch's)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/doctor"),
                   help="folder for doctor.json and roofline.png (default benchmarks/results/doctor)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from doctor.config import DoctorConfig
    from doctor.plot import write_roofline
    from doctor.report import format_report

    config = DoctorConfig(
        model=args.model, artifact=args.artifact, base_url=args.base_url, api_key=args.api_key, dtype=args.dtype,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        device=args.device, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        input_len=args.input_len, output_len=args.output_len, num_requests=args.num_requests,
        max_prefill=args.max_prefill, enable_prefix_caching=not args.no_prefix_caching, out_dir=args.out)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    start = time.perf_counter()

    def progress(message: str) -> None:
        if not args.quiet:
            print(f"doctor [{time.perf_counter() - start:5.1f} s] {message}", file=sys.stderr, flush=True)

    if config.base_url is not None:
        from doctor.remote import run_remote

        report = run_remote(config, on_progress=progress)
    else:
        from doctor.local import run_local

        report = run_local(config, on_progress=progress, serialize_token=sse_chunk_writer())
    report.files = [report.write_json(config.out_dir / "doctor.json"),
                    write_roofline(report, config.out_dir / "roofline.png")]
    print(format_report(report))
    print(f"wrote {', '.join(str(f) for f in report.files)}")
    return 0


def sse_chunk_writer() -> Callable[[str], bytes] | None:
    """The bytes the server writes for one streamed chat token (server/generation.py `sse`, the chunk
    `stream_events` builds), for the doctor's step breakdown; None without the server extra."""
    try:
        from server.generation import sse
    except ImportError:
        return None
    base = {"id": "chatcmpl-doctor", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": "doctor"}

    def write(text: str) -> bytes:
        choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        return sse({**base, "choices": [choice]}).encode()
    return write
