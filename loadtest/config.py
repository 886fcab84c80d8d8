"""Typed, validated configuration of one load test; argument parsing lives only in cli.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

ENDPOINTS = ("completions", "chat", "responses")
DATASETS = ("random", "file")
SWEEP_KINDS = ("rate", "concurrency")
SLO_KEYS = ("ttft", "tpot", "itl", "e2e")
DEFAULT_NUM_REQUESTS = 100
DEFAULT_OUTPUT_LEN = 128


class LoadTestError(Exception):
    """A problem the user can fix (bad flags, unreachable server); reported as one line."""


@dataclass(frozen=True)
class WorkloadConfig:
    dataset: str = "random"
    dataset_path: str | None = None
    input_len: int = 256
    # None: random prompts use DEFAULT_OUTPUT_LEN, file records use their own length when they have one.
    output_len: int | None = None
    range_ratio: float = 0.0
    prefix_len: int = 0
    seed: int = 0
    tokenizer_path: str | None = None
    num_prefixes: int = 1  # distinct shared prefixes: request i starts with prefix i mod num_prefixes

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise LoadTestError(f"--dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}")
        if self.dataset == "file" and not self.dataset_path:
            raise LoadTestError("--dataset file needs --dataset-path")
        if self.input_len < 1:
            raise LoadTestError(f"--input-len must be at least 1, got {self.input_len}")
        if self.output_len is not None and self.output_len < 1:
            raise LoadTestError(f"--output-len must be at least 1, got {self.output_len}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise LoadTestError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.prefix_len < 0:
            raise LoadTestError(f"--prefix-len must be at least 0, got {self.prefix_len}")
        if self.num_prefixes < 1:
            raise LoadTestError(f"--num-prefixes must be at least 1, got {self.num_prefixes}")
        if self.num_prefixes > 1 and self.prefix_len == 0:
            raise LoadTestError("--num-prefixes needs --prefix-len")


@dataclass(frozen=True)
class LoadShape:
    """How requests are offered: open loop at `request_rate` (optionally capped), or closed loop."""

    request_rate: float | None = None  # req/s; math.inf sends everything at once; None: closed loop
    burstiness: float = 1.0  # gamma shape of the inter-arrival times; 1 is Poisson
    max_concurrency: int | None = None
    num_requests: int | None = None
    duration: float | None = None  # seconds

    def __post_init__(self) -> None:
        if self.request_rate is not None and not self.request_rate > 0:
            raise LoadTestError(f"--request-rate must be positive, got {self.request_rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise LoadTestError(f"--burstiness must be a positive number, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise LoadTestError(f"--max-concurrency must be at least 1, got {self.max_concurrency}")
        if self.request_rate is None and self.max_concurrency is None:
            raise LoadTestError("give --request-rate or --max-concurrency")
        if self.num_requests is not None and self.duration is not None:
            raise LoadTestError("give --num-requests or --duration, not both")
        if self.num_requests is None and self.duration is None:
            raise LoadTestError("give --num-requests or --duration")
        if self.num_requests is not None and self.num_requests < 1:
            raise LoadTestError(f"--num-requests must be at least 1, got {self.num_requests}")
        if self.duration is not None and not (self.duration > 0 and math.isfinite(self.duration)):
            raise LoadTestError(f"--duration must be a positive number of seconds, got {self.duration}")
        if self.duration is not None and self.request_rate == math.inf:
            raise LoadTestError("--duration needs a finite --request-rate (or a closed loop)")

    @property
    def is_open_loop(self) -> bool:
        return self.request_rate is not None

    @property
    def label(self) -> str:
        parts = []
        if self.request_rate is not None:
            parts.append(f"rate={format_number(self.request_rate)}")
        if self.max_concurrency is not None:
            parts.append(f"concurrency={self.max_concurrency}")
        return ",".join(parts)


@dataclass(frozen=True)
class Sweep:
    kind: str
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.kind not in SWEEP_KINDS:
            raise LoadTestError(f"--sweep kind must be rate or concurrency, got {self.kind!r}")
        if not self.values:
            raise LoadTestError("--sweep needs at least one value")
        if self.kind == "concurrency" and any(v != int(v) or v < 1 for v in self.values):
            raise LoadTestError("--sweep concurrency values must be whole numbers of at least 1")

    def shapes(self, base: LoadShape) -> list[LoadShape]:
        if self.kind == "rate":
            return [replace(base, request_rate=v) for v in self.values]
        return [replace(base, max_concurrency=int(v)) for v in self.values]

    @classmethod
    def parse(cls, text: str) -> Sweep:
        kind, sep, values = text.partition("=")
        if not sep:
            raise LoadTestError(f"--sweep must look like rate=1,2,4 or concurrency=1,4,16, got {text!r}")
        try:
            parsed = tuple(float(v) for v in values.split(",") if v.strip())
        except ValueError:
            raise LoadTestError(f"--sweep values must be numbers, got {values!r}") from None
        return cls(kind.strip(), parsed)


@dataclass(frozen=True)
class Slo:
    """Per-request service-level objectives in milliseconds; a request meets them all or none."""

    limits_ms: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key, value in self.limits_ms.items():
            if key not in SLO_KEYS:
                raise LoadTestError(f"--slo keys are {', '.join(SLO_KEYS)}, got {key!r}")
            if not value > 0:
                raise LoadTestError(f"--slo {key} must be a positive number of ms, got {value}")

    @classmethod
    def parse(cls, text: str) -> Slo:
        limits = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition(":")
            try:
                limits[key.strip()] = float(value)
            except ValueError:
                raise LoadTestError(f"--slo must look like ttft:200,tpot:50, got {text!r}") from None
            if not sep:
                raise LoadTestError(f"--slo must look like ttft:200,tpot:50, got {text!r}")
        return cls(limits)

    def describe(self) -> str:
        return ", ".join(f"{key}<={format_number(ms)}ms" for key, ms in self.limits_ms.items())


@dataclass(frozen=True)
class LoadTestConfig:
    base_url: str
    model: str | None
    api_key: str | None
    endpoint: str
    workload: WorkloadConfig
    shape: LoadShape
    sweep: Sweep | None = None
    slo: Slo | None = None
    warmup: int = 0
    timeout: float = 300.0
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)
    keep_alive: bool = True  # False: a new connection per request (--no-keep-alive)
    out_dir: str | None = None
    quiet: bool = False

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise LoadTestError(f"--base-url must start with http:// or https://, got {self.base_url!r}")
        if self.endpoint not in ENDPOINTS:
            raise LoadTestError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.warmup < 0:
            raise LoadTestError(f"--warmup must be at least 0, got {self.warmup}")
        if not self.timeout > 0:
            raise LoadTestError(f"--timeout must be positive, got {self.timeout}")
        if self.temperature < 0:
            raise LoadTestError(f"--temperature must be at least 0, got {self.temperature}")

    def shapes(self) -> list[LoadShape]:
        return self.sweep.shapes(self.shape) if self.sweep else [self.shape]


def format_number(value: float) -> str:
    if value == math.inf:
        return "inf"
    return f"{value:g}"
