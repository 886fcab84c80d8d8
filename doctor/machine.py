"""This machine's limits, measured: memory copy bandwidth and matrix-multiply throughput per precision.

The matmuls run at the model's own shapes (its MLP and head, at the step sizes the sweep uses) and at a
large square reference shape; the roof is the best of them, since a small model's shapes show its
overheads, not the machine's peak. Each figure is the best of a few repetitions: these machines are
shared, and the best run is the one least disturbed by the neighbours.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from kernels.timing import time_calls

COPY_BYTES = 64 << 20  # well past any cache, so the copy streams from memory
REFERENCE_SIZE = 1024
KINDS = ("fp32", "bf16", "int8")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}


@dataclass(frozen=True)
class GemmResult:
    kind: str
    shape: tuple[int, int, int]  # (M, K, N): [M, K] @ [K, N]
    flops_per_s: float | None  # None when this machine cannot run the kind
    error: str | None = None


@dataclass(frozen=True)
class MachineLimits:
    device: str  # "cpu" or "cuda:0 (<name>)"
    threads: int
    memory_bandwidth: float  # bytes/s, read plus write of a large copy
    peak: dict[str, float]  # kind -> best FLOP/s (integer ops for int8)
    gemms: list[GemmResult] = field(default_factory=list)

    def roof(self, kind: str) -> float:
        if kind not in self.peak:
            raise ValueError(f"no {kind} matmul throughput was measured on {self.device}")
        return self.peak[kind]

    def ridge(self, kind: str) -> float:
        """FLOPs per byte where the compute roof meets the memory roof."""
        return self.roof(kind) / self.memory_bandwidth

    def to_dict(self) -> dict:
        return asdict(self)


def measure_bandwidth(device: torch.device, num_bytes: int = COPY_BYTES, reps: int = 5) -> float:
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    seconds = time_calls(lambda: target.copy_(source), warmup=1, min_reps=1, max_reps=reps, max_time=0.5,
                         device=device).best_s
    return 2 * num_bytes / seconds  # each byte is read once and written once


def operands(kind: str, m: int, k: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "int8":
        return (torch.randint(-64, 64, (m, k), dtype=torch.int8, device=device),
                torch.randint(-64, 64, (k, n), dtype=torch.int8, device=device))
    return (torch.randn(m, k, device=device).to(DTYPES[kind]), torch.randn(k, n, device=device).to(DTYPES[kind]))


def measure_gemm(kind: str, shape: tuple[int, int, int], device: torch.device, reps: int = 3) -> GemmResult:
    m, k, n = shape
    try:
        a, b = operands(kind, m, k, n, device)
        # torch._int_mm is the int8 x int8 -> int32 product the W8A8 path is built on.
        product = (lambda: torch._int_mm(a, b)) if kind == "int8" else (lambda: a @ b)
        seconds = time_calls(product, warmup=1, min_reps=1, max_reps=reps, max_time=0.3, device=device).best_s
    except (RuntimeError, NotImplementedError) as error:
        return GemmResult(kind, shape, None, " ".join(str(error).split())[:160])
    return GemmResult(kind, shape, 2.0 * m * k * n / seconds)


def int8_shape(shape: tuple[int, int, int]) -> tuple[int, int, int]:
    """torch._int_mm wants M above 16 and K, N multiples of 8 on some backends: round up to fit."""
    m, k, n = shape
    return max(m, 32), -(-k // 8) * 8, -(-n // 8) * 8


def measure_machine(device: torch.device, model_shapes: list[tuple[int, int, int]],
                    kinds: tuple[str, ...] = KINDS, on_progress: Callable[[str], None] = lambda _: None) -> MachineLimits:
    """The limits of `device`, with each kind's matmuls at `model_shapes` and at the reference shape."""
    on_progress(f"memory copy bandwidth on {device}")
    bandwidth = measure_bandwidth(device)
    reference = (REFERENCE_SIZE,) * 3
    gemms: list[GemmResult] = []
    for kind in kinds:
        on_progress(f"{kind} matmul throughput on {device}")
        for shape in [*model_shapes, reference]:
            gemms.append(measure_gemm(kind, int8_shape(shape) if kind == "int8" else shape, device))
    peak: dict[str, float] = {}
    for result in gemms:
        if result.flops_per_s is not None:
            peak[result.kind] = max(peak.get(result.kind, 0.0), result.flops_per_s)
    name = device.type if device.type != "cuda" else f"{device} ({torch.cuda.get_device_name(device)})"
    return MachineLimits(name, torch.get_num_threads(), bandwidth, peak, gemms)


def contention_note() -> str | None:
    """A warning when other processes competed for the cores during the run (the 1-minute load average
    above the core count): every time measured is then longer than this machine gives alone."""
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:  # not every platform has a load average
        return None
    if load <= cores:
        return None
    return (f"the load average was {load:.1f} on {cores} cores while measuring: other processes shared them, "
            "so the times above are longer than this machine gives alone")
