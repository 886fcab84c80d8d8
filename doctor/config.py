"""Typed, validated configuration of one `ladder doctor` run; argument parsing lives in ladder/doctor.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from model.precision import QUANTIZATIONS, parse_kv_cache_dtype


@dataclass(frozen=True)
class DoctorConfig:
    model: str | None = None  # HF directory or GGUF file; None with no artifact or URL: the embedded default
    artifact: str | None = None
    base_url: str | None = None  # a running ladder server instead of a model loaded here
    api_key: str | None = None
    dtype: str = "float32"
    # As `ladder serve --quantization` (same choices, same default): auto resolves per model and device in
    # model/quantization.py, so the doctor examines the linears serve would run.
    quantization: str = "auto"
    kv_cache_dtype: str = "auto"  # as `ladder serve --kv-cache-dtype`
    device: str | None = None  # default: cuda when present, else cpu
    max_num_seqs: int = 16  # the engine's sequence cap; the decode sweep goes up to it
    max_num_batched_tokens: int = 2048
    input_len: int = 64  # prompt tokens of the load's requests, and the decode sweep's context
    output_len: int = 16
    num_requests: int | None = None  # requests of the load, all at once; default: max_num_seqs
    max_prefill: int = 256  # the prefill sweep goes up to this many tokens
    block_size: int = 16
    enable_prefix_caching: bool = True
    out_dir: Path = Path("benchmarks/results/doctor")
    seed: int = 0

    def __post_init__(self) -> None:
        sources = [name for name in ("model", "artifact", "base_url") if getattr(self, name) is not None]
        if len(sources) > 1:
            raise ValueError(f"give one of --model, --artifact, --base-url (got {', '.join(sources)})")
        for name in ("max_num_seqs", "max_num_batched_tokens", "input_len", "output_len", "max_prefill",
                     "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.quantization not in ("auto", *QUANTIZATIONS):
            raise ValueError(f"unknown quantization {self.quantization!r} "
                             f"(choose from auto, {', '.join(QUANTIZATIONS)})")
        if self.quantization not in ("auto", "none") and self.model is None and sources:
            raise ValueError(f"--quantization {self.quantization} applies to a model loaded here, not to "
                             f"--{sources[0].replace('_', '-')} (an artifact has its compiled precision, a server "
                             "its own)")
        parse_kv_cache_dtype(self.kv_cache_dtype)
        if self.kv_cache_dtype != "auto" and self.model is None and sources:
            raise ValueError(f"--kv-cache-dtype applies to a model loaded here, not to "
                             f"--{sources[0].replace('_', '-')}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"--num-requests must be at least 1, got {self.num_requests}")

    @property
    def load_requests(self) -> int:
        return self.num_requests if self.num_requests is not None else self.max_num_seqs
