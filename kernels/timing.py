"""How long a call takes: the one timing helper of every benchmark (kernels, engine, compile, doctor).

    timing = time_calls(fn, min_time=0.3)          # samples until 0.3 s have passed, at least 5
    timing.median_s, timing.samples_s
    median_seconds(fn, device=cuda, sample_time=0.02)  # each sample a loop of calls sized to ~20 ms

A sample is the time of `calls` consecutive calls divided by `calls`. On a CUDA device a sample is
measured with events on the current stream (the device's time, not the host's time to queue the work)
and the device is synchronized after warm-up; anywhere else with `time.perf_counter`. Times are per call,
in seconds. It lives at the bottom layer, importing nothing of ladder, so every package may use it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

MAX_CALLS_PER_SAMPLE = 2000


@dataclass(frozen=True)
class Timing:
    samples_s: tuple[float, ...]  # seconds per call, one entry per sample
    calls: int  # calls per sample

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def best_s(self) -> float:
        """The fastest sample: what the hardware can do when nothing else runs (a roofline's measure)."""
        return min(self.samples_s)

    @property
    def median_ms(self) -> float:
        return self.median_s * 1e3

    @property
    def median_us(self) -> float:
        return self.median_s * 1e6


def synchronize(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def _sample(fn: Callable[[], object], calls: int, device: torch.device | None) -> float:
    """Seconds per call of `calls` calls in a row."""
    if device is not None and device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) * 1e-3 / calls
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def time_calls(fn: Callable[[], object], *, warmup: int = 3, min_reps: int = 5, min_time: float = 0.0,
               max_reps: int | None = None, max_time: float | None = None, sample_time: float = 0.0,
               device: torch.device | str | None = None) -> Timing:
    """Time fn() after `warmup` calls: at least `min_reps` samples and until `min_time` seconds have passed,
    stopping at `max_reps` samples or once the samples have taken `max_time` seconds, whichever comes
    first (the first sample is always taken). With `sample_time`, each sample is a loop of calls sized (from
    one timed call) to take about that long, at most MAX_CALLS_PER_SAMPLE calls; else each sample is one call."""
    if min_reps < 1:
        raise ValueError(f"min_reps must be at least 1, got {min_reps}")
    max_reps = max_reps if max_reps is not None else float("inf")
    device = torch.device(device) if isinstance(device, str) else device
    for _ in range(warmup):
        fn()
    synchronize(device)
    calls = 1
    if sample_time > 0:
        start = time.perf_counter()
        fn()
        synchronize(device)
        once = max(time.perf_counter() - start, 1e-6)
        calls = max(1, min(MAX_CALLS_PER_SAMPLE, int(sample_time / once)))
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < min_reps or time.perf_counter() < start + min_time:
        samples.append(_sample(fn, calls, device))
        spent = time.perf_counter() - start
        if len(samples) >= max_reps or (max_time is not None and spent > max_time):
            break
    return Timing(tuple(samples), calls)


def median_seconds(fn: Callable[[], object], **options) -> float:
    """The median seconds per call of `time_calls(fn, **options)`."""
    return time_calls(fn, **options).median_s
