"""One doctor run's findings, layer by layer, as text for the terminal and as JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from doctor.breakdown import StepBreakdown
from doctor.cost import ModelCost
from doctor.load import LoadEvidence
from doctor.machine import MachineLimits
from doctor.memory import MemoryUse
from doctor.roofline import OperatingPoint, RooflinePoint
from doctor.verdict import Verdict


@dataclass
class DoctorReport:
    model_name: str
    device: str
    cost: ModelCost
    kernels: str  # what runs the steps: backend, ops and attention
    machines: list[MachineLimits]  # the first is the device the model runs on
    sweep: list[RooflinePoint]
    load: LoadEvidence
    operating: OperatingPoint | None
    verdict: Verdict
    parallelism: str = "1 rank: no communication"
    notes: list[str] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    # (--quantization as asked, as resolved: what the linears run); asked is None for a server's or an
    # artifact's own
    quantization: tuple[str | None, str] = (None, "none")
    breakdown: StepBreakdown | None = None  # one batch-1 decode step, op by op (a model loaded here)
    memory: MemoryUse | None = None  # the process's resident memory itemized (a model loaded here, on Linux)

    @property
    def machine(self) -> MachineLimits:
        return self.machines[0]

    @property
    def load_points(self) -> list[RooflinePoint]:
        return [p for phase in ("decode", "prefill", "load") if (p := self.load.combined(phase)) is not None]

    def to_dict(self) -> dict:
        kind = self.cost.matmul_kind
        return {
            "model": {"name": self.model_name, **self.cost.summary(), "config": self.cost.config.to_dict(),
                      "quantization": {"asked": self.quantization[0], "resolved": self.quantization[1]}},
            "parallelism": self.parallelism,
            "runtime": self.load.to_dict(),
            "compile": {"kernels": self.kernels,
                        "sweep": [p.to_dict(self.machine, kind) for p in self.sweep],
                        "load": [p.to_dict(self.machine, kind) for p in self.load_points],
                        "operating_point": None if self.operating is None else {
                            "label": self.operating.label, "num_steps": self.operating.num_steps,
                            "seconds": self.operating.seconds, "fraction": self.operating.fraction,
                            "roof": self.operating.roof}},
            "step_breakdown": None if self.breakdown is None else self.breakdown.to_dict(),
            "hardware": [m.to_dict() for m in self.machines],
            "memory": None if self.memory is None else self.memory.to_dict(),
            "verdict": self.verdict.to_dict(),
            "notes": self.notes,
        }

    def write_json(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2))
        return path


def si(value: float | None, unit: str, digits: int = 1) -> str:
    if value is None:
        return "-"
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.{digits}f} {prefix}{unit}"
    return f"{value:.{digits}f} {unit}"


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def format_report(report: DoctorReport) -> str:
    cost, load, machine, kind = report.cost, report.load, report.machine, report.cost.matmul_kind
    pad = " " * 15
    lines = [f"ladder doctor · {report.model_name} · {cost.precision} on {report.device}", ""]
    asked, resolved = report.quantization
    lines.append(f"quantization   {resolved}" + (f" (--quantization {asked}, as `ladder serve` resolves it)"
                                                 if asked is not None else " (its own: --quantization does not "
                                                 "choose a server's or an artifact's)"))
    first = cost.decode_step(1, 0)
    lines.append(f"1 model        {si(cost.num_params, '', 1).replace(' ', '')} parameters · {si(cost.weight_bytes, 'B')} of weights "
                 f"read per step ({cost.precision}) · KV cache {si(cost.kv_bytes_per_token, 'B')} per token")
    lines.append(f"{pad}decode: {si(first.flops, 'FLOP')} per token, {first.intensity:.2f} FLOP/byte at batch 1; "
                 f"prefill: {si(cost.prefill_step(256).flops / 256, 'FLOP')} per token")
    lines.append(f"2 parallelism  {report.parallelism}")
    lines.append(f"3 runtime      load from {load.source}: {load.num_requests} requests at once, "
                 f"{load.wall_seconds:.2f} s, {load.output_tokens_per_s:.1f} output tokens/s")
    lines.append(f"{pad}per request: queue {ms(load.mean_queue)} ({pct(load.queue_share)} of its time) · prefill "
                 f"{ms(load.mean_prefill)} · decode {ms(load.mean_decode)} · end to end {ms(load.mean_e2e)}")
    occupancy = (f"batch occupancy {pct(load.occupancy)} ({load.mean_batch:.1f} of {load.max_num_seqs} sequences "
                 "per step)") if load.occupancy is not None else f"mean batch {load.mean_batch or 0:.1f}"
    preempted = "-" if load.num_preemptions is None else f"{load.num_preemptions:.0f}"
    lines.append(f"{pad}{occupancy} · {preempted} preemptions · prefix cache hits {pct(load.prefix_hit_rate)}")
    total = sum(load.step_seconds.values()) or 1.0
    lines.append(f"{pad}{load.num_steps} steps, time by phase: "
                 + " · ".join(f"{phase} {seconds / total:.0%}" for phase, seconds in load.step_seconds.items()))
    lines.append(f"4 compile      {report.kernels}")
    header = f"{pad}{'step':<16}{'time':>10}{'FLOP/s':>12}{'bytes/s':>12}{'FLOP/B':>9}  {'roof':<8}{'of roof':>8}"
    lines.append(header)
    for point in [*report.sweep, *report.load_points]:
        lines.append(f"{pad}{point.label:<16}{ms(point.seconds) if point.seconds >= 0.01 else f'{point.seconds * 1e3:.2f} ms':>10}"
                     f"{si(point.flops_per_s, ''):>12}{si(point.bytes_per_s, 'B'):>12}{point.cost.intensity:>9.2f}  "
                     f"{point.roof(machine, kind):<8}{pct(point.fraction(machine, kind)):>8}")
    for m in report.machines:
        peaks = " · ".join(f"{k} {si(v, 'FLOP/s' if k != 'int8' else 'OP/s')}" for k, v in m.peak.items())
        lines.append(f"5 hardware     {m.device}, {m.threads} threads: memory copy {si(m.memory_bandwidth, 'B/s')} · "
                     f"{peaks}")
    lines.append(f"{pad}ridge point ({kind}): {machine.ridge(kind):.1f} FLOP/byte")
    if report.memory is not None:
        lines.extend(format_memory(report.memory))
    if report.breakdown is not None:
        lines.append("")
        lines.extend(format_breakdown(report.breakdown))
    lines.append("")
    lines.append(f"verdict: {report.verdict.bound.upper()} bound")
    lines.extend(f"  - {reason}" for reason in report.verdict.reasons)
    lines.append(f"next step: {report.verdict.next_step}")
    lines.extend(f"note: {note}" for note in report.notes)
    return "\n".join(lines)


def format_memory(m: MemoryUse) -> list[str]:
    """The process's resident memory, itemized: weights by kind, KV cache, mapped files, the rest."""
    pad = " " * 15
    weights = " · ".join(f"{kind} {si(size, 'B')}" for kind, size in sorted(m.weights.items(), key=lambda kv: -kv[1]))
    return [f"6 memory       resident {si(m.resident, 'B')} (peak {si(m.peak, 'B')}): weights "
            f"{si(sum(m.weights.values()), 'B')} · KV cache {si(m.kv_cache, 'B')} · mapped files "
            f"{si(m.file_pages, 'B')} · the rest of the heap {si(m.rest, 'B')}",
            f"{pad}weights: {weights}; the rest: torch and the libraries, the tokenizer, the allocator's free pieces"]


def format_breakdown(b: StepBreakdown) -> list[str]:
    """The step breakdown as a table: each row's time, share of the step, and for the linears their bytes and
    the rate they read them at against the copy bandwidth."""
    first, last = b.contexts
    lines = [f"one decode step at batch 1, {b.quantization}, context {first}-{last} (median of {b.num_steps} "
             f"steps; {b.instrumented_step_seconds * 1e3:.2f} ms with the ops timed)",
             f"  {'phase':<30}{'calls':>6}{'ms':>9}{'of step':>9}{'weights':>11}{'GB/s':>8}{'of copy':>9}"]
    for p in b.phases:
        rate = p.bytes_per_s()
        lines.append(f"  {p.label:<30}{p.calls or '':>6}{p.seconds * 1e3:>9.3f}{pct(p.seconds / b.step_seconds):>9}"
                     f"{si(p.weight_bytes, 'B') if p.weight_bytes else '':>11}"
                     f"{f'{rate / 1e9:.1f}' if rate else '':>8}{pct(rate / b.memory_bandwidth) if rate else '':>9}")
    rate = b.weight_bytes / b.step_seconds
    lines.append(f"  {'engine step':<30}{'':>6}{b.step_seconds * 1e3:>9.3f}{'100%':>9}{si(b.weight_bytes, 'B'):>11}"
                 f"{rate / 1e9:>8.1f}{pct(rate / b.memory_bandwidth):>9}")
    if b.sse_seconds is not None:
        lines.append(f"  {'+ SSE chunk (server, per token)':<30}{1:>6}{b.sse_seconds * 1e3:>9.3f}")
    lines.append(f"  python dispatch (step - timed ops): {b.python_seconds * 1e3:.2f} ms, "
                 f"{pct(b.python_seconds / b.step_seconds)} of the step")
    if b.weight_bytes:
        lines.append(f"  roofline floor: {si(b.weight_bytes, 'B')} of weights / {si(b.memory_bandwidth, 'B/s')} copy "
                     f"bandwidth = {b.floor_seconds * 1e3:.3f} ms; the step takes {b.step_seconds * 1e3:.3f} ms, "
                     f"{pct(b.floor_fraction)} of the floor's speed")
    lines.extend(f"  note: {note}" for note in b.notes)
    return lines
