"""The figures of one run, computed from its request records exactly as loadtest/README.md defines them."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np

from loadtest.client import RequestRecord
from loadtest.config import Slo
from loadtest.runner import RunResult

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles (linear interpolation between closest ranks) of a set of values."""

    count: int
    mean: float
    median: float
    p90: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: list[float], scale: float = 1.0) -> Distribution | None:
        if not values:
            return None
        array = np.asarray(values, dtype=np.float64) * scale
        p50, p90, p95, p99 = np.percentile(array, PERCENTILES).tolist()
        return cls(len(values), float(array.mean()), p50, p90, p95, p99, float(array.max()))


@dataclass(frozen=True)
class Summary:
    num_requests: int
    num_ok: int
    num_failed: int
    failures: dict[str, int]  # by kind: http_<status>, timeout, broken_stream, ...
    duration_s: float
    request_throughput: float  # successful requests per second
    input_tokens: int
    output_tokens: int
    output_tokens_requested: int  # max_tokens summed over the successful requests
    output_throughput: float  # output tokens per second
    total_token_throughput: float  # input and output tokens per second
    token_sources: dict[str, dict[str, int]]  # {"input"|"output": {source: requests}}
    max_in_flight: int
    offered_rate: float | None  # req/s asked for; None in a closed loop
    achieved_arrival_rate: float | None  # (n - 1) / (last send - first send), all requests
    send_lag_ms: Distribution | None  # actual send minus scheduled send (open loop)
    ttft_ms: Distribution | None
    tpot_ms: Distribution | None
    itl_ms: Distribution | None
    e2e_ms: Distribution | None
    slo: dict[str, float] | None
    goodput: float | None  # successful requests meeting every SLO, per second
    slo_attainment: float | None  # the fraction of all requests that did

    def to_dict(self) -> dict:
        return asdict(self)


def meets_slo(record: RequestRecord, slo: Slo) -> bool:
    if not record.ok:
        return False
    seconds = {key: ms / 1000 for key, ms in slo.limits_ms.items()}
    checks = {
        "ttft": record.ttft,
        "tpot": record.tpot,
        "itl": max(record.itls, default=None),  # every gap between chunks
        "e2e": record.e2e,
    }
    # A value that does not exist (TPOT of a one-token answer) cannot break its objective.
    return all(checks[key] is None or checks[key] <= limit for key, limit in seconds.items())


def summarize(result: RunResult, slo: Slo | None = None) -> Summary:
    records = result.records
    ok = [r for r in records if r.ok]
    duration = result.duration
    per_second = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens or 0 for r in ok)
    sent = sorted(r.sent for r in records)
    arrival_rate = (len(sent) - 1) / (sent[-1] - sent[0]) if len(sent) > 1 and sent[-1] > sent[0] else None
    lags = [r.lag for r in records if r.lag is not None]
    good = [r for r in records if meets_slo(r, slo)] if slo and slo.limits_ms else None
    return Summary(
        num_requests=len(records),
        num_ok=len(ok),
        num_failed=len(records) - len(ok),
        failures=dict(Counter(r.error_kind for r in records if not r.ok).most_common()),
        duration_s=duration,
        request_throughput=per_second(len(ok)),
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        output_tokens_requested=sum(r.max_tokens for r in ok),
        output_throughput=per_second(output_tokens),
        total_token_throughput=per_second(input_tokens + output_tokens),
        token_sources={
            "input": dict(Counter(r.prompt_tokens_source for r in ok)),
            "output": dict(Counter(r.output_tokens_source for r in ok)),
        },
        max_in_flight=result.max_in_flight,
        offered_rate=result.shape.request_rate,
        achieved_arrival_rate=arrival_rate,
        send_lag_ms=Distribution.of(lags, 1000),
        ttft_ms=Distribution.of([r.ttft for r in ok if r.ttft is not None], 1000),
        tpot_ms=Distribution.of([r.tpot for r in ok if r.tpot is not None], 1000),
        itl_ms=Distribution.of([gap for r in ok for gap in r.itls], 1000),
        e2e_ms=Distribution.of([r.e2e for r in ok if r.e2e is not None], 1000),
        slo=dict(slo.limits_ms) if slo and slo.limits_ms else None,
        goodput=per_second(len(good)) if good is not None else None,
        slo_attainment=(len(good) / len(records) if records else 0.0) if good is not None else None,
    )
