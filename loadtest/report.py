"""The terminal report and results.json."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

from loadtest.client import RequestRecord
from loadtest.config import LoadTestConfig, format_number
from loadtest.metrics import Distribution, Summary
from loadtest.runner import RunResult
from loadtest.server_metrics import ServerBreakdown

NOT_LADDER = "not a ladder server"
LAG_WARNING_MS = 10.0  # a p99 send lag above this means the client could not keep the schedule
LATENCY_ROWS = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))


@dataclass
class PointResult:
    """One load shape of a run (the only one, or one point of a sweep)."""

    run: RunResult
    summary: Summary
    server: ServerBreakdown | None


def thousands(value: float) -> str:
    return f"{value:,.0f}"


def sources(counts: dict[str, int]) -> str:
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{source} {n}" for source, n in counts.items()) or "none"


def latency_table(summary: Summary) -> list[str]:
    lines = [f"{'latency (ms)':<14}{'mean':>10}{'median':>10}{'p90':>10}{'p95':>10}{'p99':>10}{'count':>9}"]
    for title, key in LATENCY_ROWS:
        d: Distribution | None = getattr(summary, key)
        if d is None:
            lines.append(f"{title:<14}{'-':>10}")
        else:
            lines.append(f"{title:<14}{d.mean:>10.2f}{d.median:>10.2f}{d.p90:>10.2f}{d.p95:>10.2f}"
                         f"{d.p99:>10.2f}{d.count:>9}")
    return lines


def format_point(point: PointResult, header: str) -> str:
    s = point.summary
    failures = ", ".join(f"{kind} {n}" for kind, n in s.failures.items())
    lines = [header,
             f"{'requests':<16}{s.num_requests} sent, {s.num_ok} ok, {s.num_failed} failed"
             + (f" ({failures})" if failures else ""),
             f"{'duration':<16}{s.duration_s:.2f} s"]
    if s.offered_rate is not None:
        achieved = f"{s.achieved_arrival_rate:.2f} req/s" if s.achieved_arrival_rate else "-"
        lag = s.send_lag_ms
        lag_text = f"; send lag mean {lag.mean:.2f} ms, p99 {lag.p99:.2f} ms, max {lag.max:.2f} ms" if lag else ""
        lines.append(f"{'arrivals':<16}offered {format_number(s.offered_rate)} req/s, achieved {achieved}{lag_text}")
    lines.append(f"{'throughput':<16}{s.request_throughput:.2f} req/s | output {s.output_throughput:.1f} tok/s | "
                 f"total {s.total_token_throughput:.1f} tok/s | max in flight {s.max_in_flight}")
    lines.append(f"{'tokens':<16}input {thousands(s.input_tokens)} ({sources(s.token_sources['input'])}) | "
                 f"output {thousands(s.output_tokens)} of {thousands(s.output_tokens_requested)} requested "
                 f"({sources(s.token_sources['output'])})")
    if s.goodput is not None:
        slo = ", ".join(f"{k}<={format_number(v)}ms" for k, v in s.slo.items())
        lines.append(f"{'goodput':<16}{s.goodput:.2f} req/s ({s.slo_attainment:.1%} of requests meet {slo})")
    lines.append("")
    lines.extend(latency_table(s))
    lines.extend(warnings(s))
    lines.append("")
    if point.server is not None:
        lines.extend(server_section(point.server, s))
    else:
        lines.append(f"server metrics: {NOT_LADDER}")
    return "\n".join(lines)


def warnings(s: Summary) -> list[str]:
    out = []
    if s.send_lag_ms is not None and s.send_lag_ms.p99 > LAG_WARNING_MS:
        out.append(f"warning: p99 send lag {s.send_lag_ms.p99:.1f} ms: the client fell behind its schedule "
                   "(or waited for --max-concurrency); the offered load was lower than asked")
    if s.output_tokens_requested and s.output_tokens < 0.99 * s.output_tokens_requested:
        out.append(f"warning: {thousands(s.output_tokens)} output tokens of {thousands(s.output_tokens_requested)} "
                   "requested: the server stopped early (ignore_eos not honoured?)")
    if set(s.token_sources["output"]) - {"usage"}:
        out.append("note: output tokens not from the server's usage are counted by a tokenizer or per chunk")
    return ["", *out] if out else []


def server_section(server: ServerBreakdown, s: Summary) -> list[str]:
    lines = ["server (ladder /metrics, change over the run)"]
    phases = server.phases
    if phases:
        lines.append(f"{'':<16}{'mean ms':>10}{'of E2E':>9}{'p50 ms':>10}{'p99 ms':>10}{'count':>8}")
        e2e = s.e2e_ms.mean if s.e2e_ms else None
        for key in ("queue", "prefill", "decode", "ttft"):
            p = phases.get(key)
            if p is None:
                continue
            share = f"{p.mean_ms / e2e:.1%}" if e2e and p.mean_ms is not None and key != "ttft" else ""
            lines.append(f"{key:<16}{fmt(p.mean_ms):>10}{share:>9}{fmt(p.p50_ms):>10}{fmt(p.p99_ms):>10}{p.count:>8}")
        parts = [phases[k].mean_ms if k in phases else None for k in ("queue", "prefill", "decode")]
        if e2e and None not in parts:
            other = e2e - sum(parts)
            lines.append(f"{'other':<16}{other:>10.2f}{other / e2e:>9.1%}   client, network, HTTP, detokenizing")
    steps = server.step_seconds
    step_total = sum(steps.values())
    if step_total > 0:
        shares = " | ".join(f"{phase} {seconds / step_total:.1%}" for phase, seconds in steps.items())
        lines.append(f"{'engine steps':<16}{step_total:.2f} s: {shares}")
    counts = []
    if server.prompt_tokens is not None:
        counts.append(f"prompt {thousands(server.prompt_tokens)}")
    if server.generation_tokens is not None:
        counts.append(f"generation {thousands(server.generation_tokens)}")
    if server.finished:
        counts.append("finished: " + ", ".join(f"{r} {thousands(n)}" for r, n in server.finished.items()))
    if counts:
        lines.append(f"{'tokens':<16}" + " | ".join(counts))
    return lines


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def sweep_table(kind: str, points: list[PointResult]) -> str:
    columns = (f"{'point':<18}{'ok':>6}{'failed':>7}{'req/s':>8}{'out tok/s':>11}{'TTFT p50':>10}"
               f"{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}{'goodput':>9}")
    lines = [f"sweep over {kind}", columns]
    for point in points:
        s = point.summary
        ttft, tpot = s.ttft_ms, s.tpot_ms
        lines.append(
            f"{point.run.shape.label:<18}{s.num_ok:>6}{s.num_failed:>7}{s.request_throughput:>8.2f}"
            f"{s.output_throughput:>11.1f}{fmt(ttft and ttft.median):>10}{fmt(ttft and ttft.p99):>10}"
            f"{fmt(tpot and tpot.median):>10}{fmt(tpot and tpot.p99):>10}"
            f"{fmt(s.goodput) if s.goodput is not None else '-':>9}")
    return "\n".join(lines)


def record_dict(record: RequestRecord) -> dict:
    out = asdict(record)
    out["lag"] = record.lag
    out["tpot"] = record.tpot
    out["chunk_times"] = [round(t, 6) for t in record.chunk_times]
    return out


def environment() -> dict:
    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "ladder": version("ladder"),
        "aiohttp": version("aiohttp"),
        "numpy": version("numpy"),
        "argv": redact_argv(sys.argv),
    }


def redact_argv(argv: list[str]) -> list[str]:
    out = []
    for i, arg in enumerate(argv):
        if i > 0 and argv[i - 1] == "--api-key":
            out.append("<redacted>")
        elif arg.startswith("--api-key="):
            out.append("--api-key=<redacted>")
        else:
            out.append(arg)
    return out


def json_safe(value: object) -> object:
    """Strict JSON: infinite rates become the string "inf", NaN becomes null."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else value
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_results(out_dir: Path, config: LoadTestConfig, model: str, points: list[PointResult]) -> Path:
    document = {
        "config": {**asdict(config), "api_key": "<redacted>" if config.api_key else None},
        "model": model,
        "environment": environment(),
        "points": [
            {
                "label": p.run.shape.label,
                "shape": asdict(p.run.shape),
                "started_at": datetime.fromtimestamp(p.run.started_at, UTC).isoformat(),
                "summary": p.summary.to_dict(),
                "server_metrics": p.server.to_dict() if p.server else None,
                "server_metrics_note": None if p.server else NOT_LADDER,
                "requests": [record_dict(r) for r in p.run.records],
            }
            for p in points
        ],
    }
    path = out_dir / "results.json"
    path.write_text(json.dumps(json_safe(document), indent=1, allow_nan=False) + "\n")
    return path
