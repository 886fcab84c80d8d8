"""How a model's final hidden states become one embedding vector per text.

An embedding model built on a decoder (Qwen3-Embedding, gte-Qwen2, e5-mistral) is the decoder plus a
pooling rule: the last token's hidden state (it has seen the whole text), the mean over the tokens, or the
first token's; then usually an L2 normalization. The rule comes with the checkpoint (sentence-transformers'
`modules.json` and its Pooling module's `config.json` in a Hugging Face directory, `{arch}.pooling_type` in a
GGUF file); a model without one (a plain chat model) pools the last token and normalizes, as vLLM does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

POOLING_KINDS = ("last", "mean", "cls")
# llama.cpp's enum llama_pooling_type, as GGUF files store it: 0 none, 1 mean, 2 cls, 3 last, 4 rank.
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
# sentence-transformers' Pooling config flags, by the kind each selects.
SENTENCE_TRANSFORMERS_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
                               "pooling_mode_cls_token": "cls"}


@dataclass(frozen=True)
class Pooling:
    kind: str = "last"  # one of POOLING_KINDS
    normalize: bool = True  # L2-normalize the pooled vector (after any truncation to fewer dimensions)

    def __post_init__(self) -> None:
        if self.kind not in POOLING_KINDS:
            raise ValueError(f"unknown pooling {self.kind!r} (choose from {', '.join(POOLING_KINDS)})")


def hf_dir_pooling(path: Path) -> Pooling | None:
    """The pooling a sentence-transformers directory declares, or None (no modules.json, or a rule this
    server does not implement: logged, and the default applies)."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text(encoding="utf-8"))
        types = [str(m.get("type", "")) for m in modules]
        pooling_module = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
        if pooling_module is None:
            return None
        config = json.loads((path / str(pooling_module["path"]) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        log.warning("%s: cannot read the sentence-transformers pooling (%s); the default applies", path, error)
        return None
    kinds = [kind for flag, kind in SENTENCE_TRANSFORMERS_MODES.items() if config.get(flag)]
    others = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v
                    and k not in SENTENCE_TRANSFORMERS_MODES)
    if len(kinds) != 1 or others:
        log.warning("%s: pooling %s is not implemented (one of %s); the default applies", path,
                    ", ".join(others or kinds) or "none", ", ".join(POOLING_KINDS))
        return None
    return Pooling(kinds[0], normalize=any(t.endswith(".Normalize") for t in types))


def gguf_pooling(metadata: Mapping[str, Any]) -> Pooling | None:
    """The pooling a GGUF file declares (`{arch}.pooling_type`), or None. llama.cpp normalizes embeddings
    by default, so a declared rule normalizes too."""
    arch = metadata.get("general.architecture")
    value = metadata.get(f"{arch}.pooling_type")
    if value is None or int(value) in (0, 4):  # none; rank: a reranker file, read by /v1/rerank
        return None
    kind = GGUF_POOLING.get(int(value))
    if kind is None:
        log.warning("GGUF pooling_type %s is not implemented; the default applies", value)
        return None
    return Pooling(kind)


def finish_embedding(pooled: torch.Tensor, normalize: bool, dimensions: int | None = None) -> torch.Tensor:
    """pooled [hidden] float32 -> the embedding: its first `dimensions` values (Matryoshka models are
    trained so that a prefix is an embedding too), then L2-normalized when `normalize`."""
    vector = pooled[:dimensions] if dimensions is not None else pooled
    if normalize:
        vector = torch.nn.functional.normalize(vector.double(), dim=0).float()
    return vector
