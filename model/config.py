"""The one configuration every supported checkpoint is mapped onto.

Hugging Face `config.json` files and GGUF metadata both end up as a `ModelConfig`, so the decoder in
`model/llama.py` never needs to know where its weights came from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Families that share the Llama decoder. Differences are flags on the config, not subclasses:
#   llama, mistral: plain;  qwen2: q/k/v biases;  qwen3: per-head RMSNorm on q and k.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1/3.2 frequency scaling (`rope_type: llama3`). Other types are rejected at load."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    rope_scaling: RopeScaling | None = None
    # GGUF files store Llama 3 scaling as per-frequency divisors (llama.cpp's `rope_freqs` tensor)
    # instead of the four numbers above; either describes the same rotation.
    rope_freq_factors: tuple[float, ...] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unknown architecture {self.architecture!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(
                f"rope_freqs has {len(self.rope_freq_factors)} entries, expected head_dim/2 = {self.head_dim // 2}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able fields; `from_dict` reads them back (artifacts store their config this way)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        fields = dict(data)
        if fields.get("rope_scaling") is not None:
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        if fields.get("rope_freq_factors") is not None:
            fields["rope_freq_factors"] = tuple(fields["rope_freq_factors"])
        fields["eos_token_ids"] = tuple(fields.get("eos_token_ids") or ())
        return cls(**fields)

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        """Map a Hugging Face `config.json` (transformers 4.x or 5.x spelling) onto a ModelConfig.

        Raises ValueError (or KeyError for a missing field) with a message the loader prefixes with
        the file name.
        """
        arch = cfg.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unknown architecture model_type={arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        # transformers 5 moved rope_theta and rope_scaling into one `rope_parameters` dict.
        rope = dict(cfg.get("rope_parameters") or {})
        legacy_scaling = cfg.get("rope_scaling") or {}
        rope = {**legacy_scaling, **rope}
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, llama3)")
        sliding_window = cfg.get("sliding_window")
        if arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
            sliding_window = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2's q/k/v projections always carry biases; its config has no flag for it.
            attention_bias=True if arch == "qwen2" else bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            sliding_window=int(sliding_window) if sliding_window else None,
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
