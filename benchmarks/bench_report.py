"""The JSON report the CPU benchmarks write (benchmarks/cpu_*_bench.py, sampler_bench.py, bf16_decode_step.py)."""

from __future__ import annotations

import json
import os
import platform
from typing import Any

import torch


def write_report(path: str, rows: list[dict[str, Any]], **extra: Any) -> None:
    """The rows as JSON at `path`, with the machine they were measured on and any `extra` fields."""
    result = {"torch": torch.__version__, "threads": torch.get_num_threads(),
              "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
              **extra, "rows": rows}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")
