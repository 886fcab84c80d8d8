"""A ladder server's own account of a run: Prometheus text scraped from /metrics before and after.

Every metric name loadtest reads is defined here and nowhere else.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import asdict, dataclass

QUEUE_SECONDS = "ladder_request_queue_seconds"  # histogram: arrival to first scheduled
PREFILL_SECONDS = "ladder_request_prefill_seconds"  # histogram: first scheduled to first token
DECODE_SECONDS = "ladder_request_decode_seconds"  # histogram: first token to finish
TTFT_SECONDS = "ladder_time_to_first_token_seconds"  # histogram: arrival to first token
STEP_SECONDS = "ladder_engine_step_seconds_total"  # counter, label phase
STEP_PHASES = ("schedule", "prepare", "forward", "sample")
PROMPT_TOKENS = "ladder_prompt_tokens_total"  # counter
GENERATION_TOKENS = "ladder_generation_tokens_total"  # counter
REQUESTS_FINISHED = "ladder_requests_finished_total"  # counter, label reason
HISTOGRAMS = {"queue": QUEUE_SECONDS, "prefill": PREFILL_SECONDS, "decode": DECODE_SECONDS,
              "ttft": TTFT_SECONDS}
LADDER_NAMES = (*HISTOGRAMS.values(), STEP_SECONDS, PROMPT_TOKENS, GENERATION_TOKENS, REQUESTS_FINISHED)

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?\s*$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_prometheus(text: str) -> Samples:
    """Samples of the text exposition format, keyed by (name, sorted labels); bad lines are skipped."""
    samples: Samples = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = SAMPLE.match(line)
        if not match:
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        pairs = tuple(sorted((k, v.replace('\\"', '"').replace("\\\\", "\\")) for k, v in LABEL.findall(labels or "")))
        samples[(name, pairs)] = number
    return samples


def is_ladder(samples: Samples) -> bool:
    names = {name for name, _ in samples}
    return any(name.startswith(LADDER_NAMES) for name in names)


def delta(before: Samples, after: Samples) -> Samples:
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def total(samples: Samples, name: str) -> float | None:
    values = [v for (n, _), v in samples.items() if n == name]
    return sum(values) if values else None


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for (n, labels), value in samples.items():
        if n == name:
            out[dict(labels).get(label, "")] += value
    return dict(out)


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus's estimate: linear interpolation inside the bucket that holds rank q * count."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for bound in bounds:
        cumulative = buckets[bound]
        if cumulative >= rank:
            if math.isinf(bound):
                return lower
            if cumulative == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (cumulative - below)
        lower, below = bound, cumulative
    return lower


@dataclass(frozen=True)
class PhaseTime:
    count: int
    mean_ms: float | None
    p50_ms: float | None  # from the histogram's buckets, so only as fine as they are
    p99_ms: float | None


def phase_time(samples: Samples, name: str) -> PhaseTime | None:
    count, seconds = total(samples, f"{name}_count"), total(samples, f"{name}_sum")
    if not count:
        return None
    buckets = {float(le): n for le, n in by_label(samples, f"{name}_bucket", "le").items() if le}
    p50, p99 = histogram_quantile(0.5, buckets), histogram_quantile(0.99, buckets)
    return PhaseTime(round(count), seconds / count * 1000 if seconds is not None else None,
                     p50 * 1000 if p50 is not None else None, p99 * 1000 if p99 is not None else None)


@dataclass(frozen=True)
class ServerBreakdown:
    """What the server's counters moved by during a run (all its traffic, not only this client's)."""

    phases: dict[str, PhaseTime]  # queue, prefill, decode, ttft
    step_seconds: dict[str, float]  # engine step time by phase
    prompt_tokens: float | None
    generation_tokens: float | None
    finished: dict[str, float]  # requests by finish reason

    def to_dict(self) -> dict:
        return asdict(self)


def breakdown(before_text: str | None, after_text: str | None) -> ServerBreakdown | None:
    """None unless both scrapes are a ladder server's."""
    if before_text is None or after_text is None:
        return None
    before, after = parse_prometheus(before_text), parse_prometheus(after_text)
    if not is_ladder(after):
        return None
    moved = delta(before, after)
    phases = {key: p for key, name in HISTOGRAMS.items() if (p := phase_time(moved, name)) is not None}
    steps = by_label(moved, STEP_SECONDS, "phase")
    return ServerBreakdown(
        phases=phases,
        step_seconds={phase: steps[phase] for phase in (*STEP_PHASES, *sorted(set(steps) - set(STEP_PHASES)))
                      if phase in steps},
        prompt_tokens=total(moved, PROMPT_TOKENS),
        generation_tokens=total(moved, GENERATION_TOKENS),
        finished={reason: n for reason, n in by_label(moved, REQUESTS_FINISHED, "reason").items() if n},
    )
