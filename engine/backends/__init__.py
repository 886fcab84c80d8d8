"""Runtimes of compiled artifacts as step models (model/step.py): compiled torch, ONNX Runtime, TensorRT.

`compile/` writes artifacts; this package reads and runs them, so serving never imports the compiler.
The names below are imported on first use: a runtime module alone needs no tokenizer.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.backends.artifact import LoadedArtifact, load_artifact
    from engine.backends.manifest import ArtifactError, Manifest

_HOMES = {"LoadedArtifact": "engine.backends.artifact", "load_artifact": "engine.backends.artifact",
          "ArtifactError": "engine.backends.manifest", "Manifest": "engine.backends.manifest"}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'engine.backends' has no attribute {name!r}")
