"""Timing and reporting shared by the CPU kernel benchmarks (`kernels/bench_cpu_*.py`)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Any

import torch


def median_us(fn, min_time: float, min_reps: int = 5) -> float:
    """Median microseconds of fn() after three warm-up calls, over at least min_reps calls and min_time s."""
    for _ in range(3):
        fn()
    times = []
    deadline = time.perf_counter() + min_time
    while len(times) < min_reps or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def write_report(path: str, rows: list[dict[str, Any]], **extra: Any) -> None:
    """The rows as JSON at `path`, with the machine they were measured on and any `extra` fields."""
    result = {"torch": torch.__version__, "threads": torch.get_num_threads(),
              "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
              **extra, "rows": rows}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")
