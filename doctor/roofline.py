"""A measured step placed against the machine's roof: how much of the time the roof explains, and which
roof (memory or compute) it is under."""

from __future__ import annotations

from dataclasses import dataclass

from doctor.cost import StepCost
from doctor.machine import MachineLimits


@dataclass(frozen=True)
class RooflinePoint:
    label: str  # e.g. "decode b=8"
    phase: str  # "decode", "prefill", or "load" (the steps of the load, mixed)
    num_tokens: int  # new tokens the step computes
    seconds: float  # measured time of the model's forward
    cost: StepCost

    def memory_seconds(self, machine: MachineLimits) -> float:
        return self.cost.bytes / machine.memory_bandwidth

    def compute_seconds(self, machine: MachineLimits, kind: str) -> float:
        return self.cost.flops / machine.roof(kind)

    def roof_seconds(self, machine: MachineLimits, kind: str) -> float:
        """The least time the roofline allows this step."""
        return max(self.memory_seconds(machine), self.compute_seconds(machine, kind))

    def fraction(self, machine: MachineLimits, kind: str) -> float:
        """Achieved fraction of the roofline: 1.0 is a step as fast as the machine allows."""
        return self.roof_seconds(machine, kind) / self.seconds

    def roof(self, machine: MachineLimits, kind: str) -> str:
        """The roof over this step: "memory" left of the ridge point, "compute" right of it."""
        return "memory" if self.memory_seconds(machine) >= self.compute_seconds(machine, kind) else "compute"

    @property
    def flops_per_s(self) -> float:
        return self.cost.flops / self.seconds

    @property
    def bytes_per_s(self) -> float:
        return self.cost.bytes / self.seconds

    def to_dict(self, machine: MachineLimits, kind: str) -> dict:
        return {"label": self.label, "phase": self.phase, "num_tokens": self.num_tokens, "seconds": self.seconds,
                "bytes": self.cost.bytes, "flops": self.cost.flops, "intensity": self.cost.intensity,
                "flops_per_s": self.flops_per_s, "bytes_per_s": self.bytes_per_s,
                "roof": self.roof(machine, kind), "fraction": self.fraction(machine, kind)}


def combine(label: str, phase: str, points: list[RooflinePoint]) -> RooflinePoint | None:
    """Many steps as one point: their bytes, FLOPs and seconds summed."""
    if not points:
        return None
    cost = StepCost(sum(p.cost.bytes for p in points), sum(p.cost.flops for p in points))
    return RooflinePoint(label, phase, sum(p.num_tokens for p in points), sum(p.seconds for p in points), cost)


@dataclass(frozen=True)
class OperatingPoint:
    """Where a run of steps sits: the share of their time the roofline explains, and the roof over most of
    that time (each step judged on its own, so a mixed load of prefills and decodes is counted right)."""

    label: str
    num_steps: int
    seconds: float
    roof_seconds: float
    memory_bound_seconds: float  # measured time of the steps left of the ridge
    compute_bound_seconds: float

    @property
    def fraction(self) -> float:
        return self.roof_seconds / self.seconds if self.seconds > 0 else 0.0

    @property
    def roof(self) -> str:
        return "memory" if self.memory_bound_seconds >= self.compute_bound_seconds else "compute"


def operating_point(label: str, points: list[RooflinePoint], machine: MachineLimits, kind: str) -> OperatingPoint | None:
    if not points:
        return None
    memory = sum(p.seconds for p in points if p.roof(machine, kind) == "memory")
    return OperatingPoint(label, len(points), sum(p.seconds for p in points),
                          sum(p.roof_seconds(machine, kind) for p in points), memory,
                          sum(p.seconds for p in points) - memory)
