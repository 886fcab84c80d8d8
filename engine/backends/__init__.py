"""Runtimes of compiled artifacts as step models (model/step.py): compiled torch, ONNX Runtime, TensorRT.

`compile/` writes artifacts; this package reads and runs them, so serving never imports the compiler.
"""

from engine.backends.artifact import LoadedArtifact, load_artifact
from engine.backends.manifest import ArtifactError, Manifest

__all__ = ["ArtifactError", "LoadedArtifact", "Manifest", "load_artifact"]
