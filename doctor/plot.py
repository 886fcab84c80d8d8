"""The roofline as a PNG: the machine's roofs, and the steps measured against them."""

from __future__ import annotations

from pathlib import Path

from doctor.report import DoctorReport

OTHER_ROOF_STYLES = {"fp32": "--", "bf16": ":", "int8": "-."}  # the roofs of the kinds the model does not use
MARKERS = {"decode": ("o", "tab:blue"), "prefill": ("s", "tab:orange"), "load": ("D", "tab:green")}


def write_roofline(report: DoctorReport, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt
    import numpy as np

    machine, kind = report.machine, report.cost.matmul_kind
    points = [*report.sweep, *report.load_points]
    intensities = [p.cost.intensity for p in points]
    low = min([*intensities, 0.1]) / 2
    high = max([*intensities, *(machine.ridge(k) for k in machine.peak)]) * 4
    x = np.geomspace(low, high, 200)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for roof_kind, peak in machine.peak.items():
        style = "-" if roof_kind == kind else OTHER_ROOF_STYLES.get(roof_kind, ":")
        ax.plot(x, np.minimum(peak, machine.memory_bandwidth * x), style, color="black" if roof_kind == kind else "grey",
                label=f"roof {roof_kind}: {peak / 1e9:.0f} G{'OP' if roof_kind == 'int8' else 'FLOP'}/s")
    for phase, (marker, color) in MARKERS.items():
        sweep = [p for p in report.sweep if p.phase == phase]
        if sweep:
            ax.plot([p.cost.intensity for p in sweep], [p.flops_per_s for p in sweep], marker=marker, color=color,
                    linestyle="--", label=f"{phase} sweep")
            for p in sweep:
                ax.annotate(p.label.split()[-1], (p.cost.intensity, p.flops_per_s), textcoords="offset points",
                            xytext=(4, -10), fontsize=7, color=color)
    for p in report.load_points:
        ax.plot(p.cost.intensity, p.flops_per_s, marker="*", markersize=14, linestyle="none",
                color=MARKERS[p.phase][1], markeredgecolor="black", label=f"{p.label} ({p.fraction(machine, kind):.0%} of roof)")
    ax.plot([], [], " ", label=f"memory copy: {machine.memory_bandwidth / 1e9:.1f} GB/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax.set_ylabel("achieved FLOP/s")
    ax.set_title(f"{report.model_name} · {report.cost.precision} on {report.device} · "
                 f"verdict: {report.verdict.bound} bound", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
