"""Open-loop arrival schedules: when each request is due, in seconds from the start of the run."""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(rate: float, num_requests: int, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times of a gamma renewal process (Poisson when `burstiness` is 1; lower is burstier).

    The sampled gaps are rescaled so that their mean is exactly 1/rate: a finite run then offers
    the rate that was asked for, and only the shape of the gaps is random. The first request is due
    at 0, the last at (num_requests - 1) / rate.
    """
    if rate == math.inf or num_requests == 1:
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests - 1)
    gaps *= (num_requests - 1) / rate / gaps.sum()
    return [0.0, *np.cumsum(gaps).tolist()]


def num_arrivals(rate: float, duration: float) -> int:
    """Requests an open loop sends in `duration` seconds: one at 0, then one every 1/rate on average."""
    return max(1, math.floor(rate * duration) + 1)
