"""One load test from configuration to figures: find the model, warm up, run each load shape between
two scrapes of the server's /metrics, and summarize."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

from loadtest.arrivals import num_arrivals
from loadtest.client import OpenAIClient, fresh_connector, tcp_connector
from loadtest.config import LoadShape, LoadTestConfig, LoadTestError, format_number
from loadtest.metrics import summarize
from loadtest.progress import Progress
from loadtest.report import PointResult
from loadtest.runner import run_shape, warm_up
from loadtest.server_metrics import breakdown
from loadtest.tokens import TokenCounter
from loadtest.workload import build_workload


@dataclass
class Measurement:
    model: str
    workload: str  # the workload's description
    points: list[PointResult]


async def measure(config: LoadTestConfig,
                  on_point: Callable[[PointResult, str], None] | None = None) -> Measurement:
    """Runs every load shape of `config`; `on_point(point, header)` sees each as soon as it is done."""
    counter = TokenCounter(config.workload.tokenizer_path) if config.workload.tokenizer_path else None
    workload = build_workload(config.workload, counter)
    client = OpenAIClient(config.base_url, config.api_key, config.endpoint, config.timeout, config.ignore_eos,
                          config.temperature, config.extra_body, counter,
                          connector=tcp_connector if config.keep_alive else fresh_connector)
    show_progress = not config.quiet and sys.stderr.isatty()
    points: list[PointResult] = []
    async with client:
        models = await client.list_models()  # also the check that the server is there at all
        client.model = config.model or (models[0] if models else None)
        if client.model is None:
            raise LoadTestError(f"{client.root}/v1/models lists no model; give --model")
        if config.warmup:
            warm = await warm_up(client, workload, config.warmup, config.shape.max_concurrency or config.warmup)
            if not any(r.ok for r in warm):
                raise LoadTestError(f"all {len(warm)} warmup requests failed; the first: {warm[0].error_kind}: "
                                    f"{warm[0].error}{hint(warm[0].error_kind)}")
        for shape in config.shapes():
            total = shape.num_requests
            if total is None and shape.is_open_loop:
                total = num_arrivals(shape.request_rate, shape.duration)
            progress = Progress(shape.label, total, shape.duration, show_progress)
            before = await client.fetch_metrics()
            result = await run_shape(client, workload, shape, config.warmup, config.workload.seed, progress)
            after = await client.fetch_metrics()
            point = PointResult(result, summarize(result, config.slo), breakdown(before, after))
            points.append(point)
            if on_point is not None:
                on_point(point, f"== {shape_name(shape)} · {config.endpoint} · model {client.model} · "
                                f"{workload.description} ==")
    return Measurement(client.model, workload.description, points)


def shape_name(shape: LoadShape) -> str:
    if not shape.is_open_loop:
        return f"closed loop, concurrency {shape.max_concurrency}"
    arrivals = "poisson" if shape.burstiness == 1 else f"gamma, burstiness {format_number(shape.burstiness)}"
    if shape.request_rate == math.inf:
        arrivals = "all at once"
    cap = f", at most {shape.max_concurrency} in flight" if shape.max_concurrency else ""
    return f"open loop {format_number(shape.request_rate)} req/s ({arrivals}){cap}"


def hint(error_kind: str | None) -> str:
    if error_kind in ("http_400", "http_422"):
        return " (if the server rejects ignore_eos, try --no-ignore-eos)"
    return ""
