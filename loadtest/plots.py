"""PNG plots of a run (matplotlib, Agg backend): latency distributions, and a sweep's
throughput-latency curves."""

from __future__ import annotations

import re
from pathlib import Path

from loadtest.metrics import Distribution
from loadtest.report import PointResult


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def file_label(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", label).strip("-")


def plot_latency(point: PointResult, path: Path, title: str) -> Path:
    """Histograms of TTFT, TPOT, ITL and E2E with their median and p99, latency against send time,
    and the number of requests in flight over the run."""
    plt = _pyplot()
    ok = [r for r in point.run.records if r.ok]
    series = {
        "TTFT (ms)": [r.ttft * 1000 for r in ok if r.ttft is not None],
        "TPOT (ms)": [r.tpot * 1000 for r in ok if r.tpot is not None],
        "ITL (ms)": [gap * 1000 for r in ok for gap in r.itls],
        "E2E latency (ms)": [r.e2e * 1000 for r in ok if r.e2e is not None],
    }
    figure, axes = plt.subplots(2, 3, figsize=(15, 8))
    for axis, (name, values) in zip(axes.flat, series.items()):
        axis.set_title(name)
        axis.set_ylabel("requests" if "ITL" not in name else "gaps")
        if not values:
            axis.text(0.5, 0.5, "no data", ha="center", va="center", transform=axis.transAxes)
            continue
        axis.hist(values, bins=min(50, max(5, len(values) // 4)), color="tab:blue", alpha=0.8)
        d = Distribution.of(values)
        for name_q, value, style in (("p50", d.median, "-"), ("p99", d.p99, "--")):
            axis.axvline(value, color="tab:red", linestyle=style, label=f"{name_q} {value:.1f}")
        axis.legend(fontsize=8)

    timeline = axes.flat[4]
    timeline.set_title("latency by send time")
    timeline.scatter([r.sent for r in ok if r.ttft is not None],
                     [r.ttft * 1000 for r in ok if r.ttft is not None], s=6, label="TTFT")
    timeline.scatter([r.sent for r in ok], [r.e2e * 1000 for r in ok], s=6, label="E2E")
    failed = [r for r in point.run.records if not r.ok]
    if failed:
        timeline.scatter([r.sent for r in failed], [0] * len(failed), s=12, marker="x", color="black",
                         label="failed")
    timeline.set_xlabel("send time (s)")
    timeline.set_ylabel("ms")
    timeline.legend(fontsize=8)

    in_flight = axes.flat[5]
    events = sorted([(r.sent, 1) for r in point.run.records] + [(r.finished, -1) for r in point.run.records])
    times, counts, current = [0.0], [0], 0
    for time_s, change in events:
        current += change
        times.append(time_s)
        counts.append(current)
    in_flight.step(times, counts, where="post")
    in_flight.set_title("requests in flight")
    in_flight.set_xlabel("time (s)")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


def plot_sweep(points: list[PointResult], path: Path, title: str) -> Path:
    """Output tokens/s against p50 and p99 of TPOT and TTFT, one marker per sweep point."""
    plt = _pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(12, 5))
    throughput = [p.summary.output_throughput for p in points]
    for axis, key, name in ((axes[0], "tpot_ms", "TPOT"), (axes[1], "ttft_ms", "TTFT")):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            values = [getattr(getattr(p.summary, key), stat) if getattr(p.summary, key) else float("nan")
                      for p in points]
            axis.plot(throughput, values, style, label=f"{name} {'p50' if stat == 'median' else 'p99'}")
        for p, x in zip(points, throughput):
            d = getattr(p.summary, key)
            if d is not None:
                axis.annotate(p.run.shape.label, (x, d.median), fontsize=7, xytext=(4, 4),
                              textcoords="offset points")
        axis.set_xlabel("output tokens/s")
        axis.set_ylabel(f"{name} (ms)")
        axis.set_title(f"{name} against throughput")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


def write_plots(out_dir: Path, points: list[PointResult], title: str, sweep: bool) -> list[Path]:
    if not sweep:
        return [plot_latency(points[0], out_dir / "latency.png", title)]
    paths = [plot_latency(p, out_dir / f"latency_{file_label(p.run.shape.label)}.png",
                          f"{title} · {p.run.shape.label}") for p in points]
    paths.append(plot_sweep(points, out_dir / "sweep.png", title))
    return paths
