"""GET /stats: the server's live figures as one JSON object, for the dashboard and `ladder doctor --base-url`.
It names no filesystem path (a client needs the model's name and shape, not where its files are).

Counters are totals since start; clients take differences between two reads for rates (tokens/s).
Latency percentiles are estimated from the Prometheus histograms' buckets, over the server's life.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import Histogram

if TYPE_CHECKING:
    from server.app import ServerState

PERCENTILES = (0.5, 0.9, 0.99)


def bucket_counts(histogram: Histogram) -> tuple[list[tuple[float, float]], float, float]:
    """([(upper bound, cumulative count)], count, sum) of an unlabelled histogram."""
    buckets, count, total = [], 0.0, 0.0
    for metric in histogram.collect():
        for sample in metric.samples:
            if sample.name.endswith("_bucket"):
                buckets.append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_count"):
                count = sample.value
            elif sample.name.endswith("_sum"):
                total = sample.value
    return sorted(buckets), count, total


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Linear interpolation inside the bucket that holds rank q * count, as Prometheus estimates it."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, cumulative in buckets:
        if cumulative >= rank:
            if math.isinf(bound):
                return lower  # past the last finite bound: the best the buckets can say
            if cumulative == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (cumulative - below)
        lower, below = bound, cumulative
    return lower


def latency(histogram: Histogram) -> dict:
    buckets, count, total = bucket_counts(histogram)
    values = {f"p{round(q * 100)}": quantile(q, buckets) for q in PERCENTILES}
    return {"count": count, "mean": total / count if count else None, **values}


def live_stats(state: ServerState) -> dict:
    engine = state.engine
    body: dict = {"time": time.time(), "ready": engine is not None and engine.is_alive and not state.draining,
                  "model": None, "engine": None}
    metrics = state.metrics
    body["latency"] = {"ttft": latency(metrics.ttft), "itl": latency(metrics.itl), "e2e": latency(metrics.e2e),
                       "queue": latency(metrics.queue)}
    if engine is None:
        return body
    info = engine.info
    config = info.engine_config
    body["model"] = {
        "name": state.model_name, "precision": info.precision,
        "config": info.model_config.to_dict() if info.model_config else None,
        "max_model_len": info.max_model_len, "num_kv_blocks": info.num_kv_blocks, "block_size": info.block_size,
        "kv_cache_dtype": info.kv_cache_dtype,
        "max_num_seqs": config.max_num_seqs if config else None,
        "max_num_batched_tokens": config.max_num_batched_tokens if config else None,
        "device": config.device if config else None,
        "artifact": Path(config.artifact).name if config and config.artifact else None,
    }
    s = engine.stats.snapshot()
    body["engine"] = {
        "num_running": s["num_running"], "num_waiting": s["num_waiting"], "kv_usage": s["kv_usage"],
        "num_blocks": s["num_blocks"], "num_free_blocks": s["num_free_blocks"],
        "prefix_queries": s["prefix_queries"], "prefix_hits": s["prefix_hits"],
        "num_preemptions": s["num_preemptions"], "num_prompt_tokens": s["num_prompt_tokens"],
        "num_generation_tokens": s["num_generation_tokens"], "num_steps": s["num_steps"],
        "step_seconds": s["seconds"], "finished": s["finished"],
    }
    return body
