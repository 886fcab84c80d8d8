"""`ladder loadtest`: measure latency and throughput of any OpenAI-compatible server over HTTP."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import sys
from pathlib import Path

from loadtest.config import (
    DEFAULT_NUM_REQUESTS,
    LoadShape,
    LoadTestConfig,
    LoadTestError,
    Slo,
    Sweep,
    WorkloadConfig,
)


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "loadtest", help="measure latency and throughput of an OpenAI-compatible server",
        description="Measure latency and throughput of any OpenAI-compatible server over HTTP. "
                    "Without --request-rate or --max-concurrency, requests go one at a time.")
    server = p.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server, with or without /v1 (default http://127.0.0.1:8000)")
    server.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    server.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer token (default: $OPENAI_API_KEY)")
    server.add_argument("--endpoint", choices=("completions", "chat", "responses"), default="completions",
                        help="/v1/completions, /v1/chat/completions or /v1/responses (OpenAI's Responses API, "
                             "the chat's messages as input) (default completions)")
    server.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="do not send ignore_eos (for servers that reject unknown fields)")
    server.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0)")
    server.add_argument("--no-keep-alive", dest="keep_alive", action="store_false",
                        help="a new connection for every request, for servers that close idle keep-alive "
                             "connections (llama.cpp's): a request on one they closed fails as a connection error")
    server.add_argument("--extra-body", default=None, metavar="JSON",
                        help='JSON object merged into every request body, e.g. \'{"top_p": 0.9}\'')
    server.add_argument("--timeout", type=float, default=300.0,
                        help="seconds one request may take in all before it counts as a timeout (default 300)")

    workload = p.add_argument_group("workload")
    workload.add_argument("--dataset", choices=("random", "file"), default="random",
                          help="random words, or prompts from --dataset-path (default random)")
    workload.add_argument("--dataset-path", default=None,
                          help="JSONL of prompts, chat messages or ShareGPT conversations (or one JSON list)")
    workload.add_argument("--input-len", type=int, default=256, help="prompt tokens of random prompts (default 256)")
    workload.add_argument("--output-len", type=int, default=None,
                          help="output tokens per request (default 128; file records may carry their own)")
    workload.add_argument("--range-ratio", type=float, default=0.0,
                          help="spread lengths uniformly over ±this fraction (default 0)")
    workload.add_argument("--prefix-len", type=int, default=0,
                          help="tokens of a prefix shared by all random prompts (default 0)")
    workload.add_argument("--num-prefixes", type=int, default=1,
                          help="distinct shared prefixes of --prefix-len tokens: request i starts with prefix "
                               "i mod N (default 1)")
    workload.add_argument("--tokenizer", dest="tokenizer_path", default=None, metavar="PATH",
                          help="tokenizer.json (or its directory): exact prompt lengths, and token counts "
                               "when the server sends no usage")
    workload.add_argument("--seed", type=int, default=0, help="seed of the workload and the arrivals (default 0)")

    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=None,
                      help="open loop: requests per second, sent on schedule (inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of inter-arrival gaps: 1 is Poisson, lower is burstier (default 1)")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="closed loop of this many users; with --request-rate, a cap on requests in flight")
    load.add_argument("--num-requests", type=int, default=None,
                      help=f"measured requests (default {DEFAULT_NUM_REQUESTS} unless --duration)")
    load.add_argument("--duration", type=float, default=None, help="seconds to keep sending new requests")
    load.add_argument("--warmup", type=int, default=0, help="requests sent first and not measured (default 0)")
    load.add_argument("--sweep", default=None, metavar="KIND=V1,V2,...",
                      help="one run per value: rate=1,2,4 or concurrency=1,4,16")
    load.add_argument("--slo", default=None, metavar="KEY:MS,...",
                      help="goodput objectives in ms, e.g. ttft:200,tpot:50 (keys ttft, tpot, itl, e2e)")

    output = p.add_argument_group("output")
    output.add_argument("--out", dest="out_dir", default=None, metavar="DIR",
                        help="write results.json and PNG plots here")
    output.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def config_from_args(args: argparse.Namespace) -> LoadTestConfig:
    sweep = Sweep.parse(args.sweep) if args.sweep else None
    rate, concurrency = args.request_rate, args.max_concurrency
    if sweep and sweep.kind == "rate":
        rate = sweep.values[0]
    elif sweep and sweep.kind == "concurrency":
        concurrency = int(sweep.values[0])
    if rate is None and concurrency is None:
        concurrency = 1
    num_requests = args.num_requests
    if num_requests is None and args.duration is None:
        num_requests = DEFAULT_NUM_REQUESTS
    extra_body = {}
    if args.extra_body:
        try:
            extra_body = json.loads(args.extra_body)
        except json.JSONDecodeError as error:
            raise LoadTestError(f"--extra-body is not valid JSON: {error.msg}") from None
        if not isinstance(extra_body, dict):
            raise LoadTestError("--extra-body must be a JSON object")
    return LoadTestConfig(
        base_url=args.base_url,
        model=args.model,
        api_key=args.api_key,
        endpoint=args.endpoint,
        workload=WorkloadConfig(args.dataset, args.dataset_path, args.input_len, args.output_len,
                                args.range_ratio, args.prefix_len, args.seed, args.tokenizer_path,
                                num_prefixes=args.num_prefixes),
        shape=LoadShape(rate, args.burstiness, concurrency, num_requests, args.duration),
        sweep=sweep,
        slo=Slo.parse(args.slo) if args.slo else None,
        warmup=args.warmup,
        timeout=args.timeout,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        extra_body=extra_body,
        keep_alive=args.keep_alive,
        out_dir=args.out_dir,
        quiet=args.quiet,
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        check_dependencies(config)
        out_dir = Path(config.out_dir) if config.out_dir else None
        if out_dir is not None:
            try:
                out_dir.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise LoadTestError(f"--out: cannot create {out_dir}: {error.strerror}") from None
        # Imported here so that `ladder --help` works without the HTTP client installed.
        from loadtest.measure import hint, measure
        from loadtest.report import format_point, sweep_table, write_results

        measurement = asyncio.run(measure(config, on_point=lambda point, header: print(
            format_point(point, header), end="\n\n", flush=True)))
    except LoadTestError as error:
        print(f"ladder loadtest: error: {error}", file=sys.stderr)
        return 1
    points = measurement.points
    if config.sweep and len(points) > 1:
        print(sweep_table(config.sweep.kind, points), end="\n\n")
    if out_dir is not None:
        from loadtest.plots import write_plots

        results = write_results(out_dir, config, measurement.model, points)
        title = f"{measurement.model} · {config.endpoint} · {measurement.workload}"
        plots = write_plots(out_dir, points, title, sweep=config.sweep is not None)
        print(f"wrote {results} and {', '.join(p.name for p in plots)}")
    for point in points:
        if point.summary.num_ok == 0:
            first = next((r for r in point.run.records if not r.ok), None)
            reason = f"; the first: {first.error_kind}: {first.error}{hint(first.error_kind)}" if first else ""
            print(f"ladder loadtest: error: no request of {point.run.shape.label} succeeded{reason}",
                  file=sys.stderr)
            return 1
    return 0


def check_dependencies(config: LoadTestConfig) -> None:
    needed = ["aiohttp", "numpy"]
    if config.out_dir:
        needed.append("matplotlib")
    if config.workload.tokenizer_path:
        needed.append("tokenizers")
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise LoadTestError(f"missing Python packages: {', '.join(missing)} (pip install {' '.join(missing)})")
