"""Loading a compiled artifact as a model the engine serves (`LLM(artifact=...)`, `ladder serve --artifact`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.backends.manifest import MANIFEST_NAME, ArtifactError, Manifest, check_device, read_manifest
from model.config import ModelConfig
from model.loader import LoadedModel
from model.step import StepModel
from model.tokenizer import Tokenizer

TOKENIZER_DIR = "tokenizer"


@dataclass
class LoadedArtifact(LoadedModel):
    """A loaded model that came from an artifact: its runtime, and the manifest it was checked against."""

    manifest: Manifest = field(kw_only=True)


def load_backend(directory: Path, manifest: Manifest, device: torch.device) -> StepModel:
    """The backend's step model from the files in `directory` (already checked against the manifest)."""
    block_size = manifest.shapes["block_size"]
    if manifest.backend == "torch-compile":
        from engine.backends import torch_compiled

        if manifest.package and manifest.package.get("file") not in manifest.files:
            # Its shared library runs as code: only a file whose checksum the manifest holds is loaded.
            raise ArtifactError(f"{directory / MANIFEST_NAME}: the compiled step {manifest.package.get('file')!r} "
                                "has no sha256 in the manifest's files")

        return torch_compiled.load(directory, manifest.precision, block_size, device, manifest.backend_options,
                                   manifest.shapes["max_model_len"], manifest.package)
    if manifest.backend == "onnx":
        from engine.backends.onnx_runtime import OnnxModel
        from model.quantization import activation_dtype

        config = ModelConfig.from_dict(manifest.model["config"])
        providers = ["CPUExecutionProvider"] if device.type == "cpu" else None  # None: CUDA first
        return OnnxModel.load(directory, config, block_size, activation_dtype(manifest.precision), providers=providers)
    from engine.backends.tensorrt_runtime import TensorRTModel

    return TensorRTModel.load(directory, manifest, device)


def load_artifact(directory: str | Path, device: str | torch.device | None = None) -> LoadedArtifact:
    """Check the manifest and every file's sha256, then load; ArtifactError says what does not match."""
    start = time.perf_counter()
    directory = Path(directory).expanduser().resolve()
    manifest = read_manifest(directory)
    device = torch.device(device or manifest.device["type"])
    check_device(manifest, device)
    step_model = load_backend(directory, manifest, device)
    return loaded_artifact(directory, manifest, step_model, time.perf_counter() - start)


def loaded_artifact(directory: Path, manifest: Manifest, step_model: StepModel, load_seconds: float) -> LoadedArtifact:
    """An artifact's step model (from `load_backend` on its files) with what the engine serves beside it."""
    tokenizer_dir = directory / TOKENIZER_DIR
    tokenizer = Tokenizer.from_saved(tokenizer_dir) if tokenizer_dir.is_dir() else None
    config = ModelConfig.from_dict(manifest.model["config"])
    name = manifest.model.get("name") or directory.name
    return LoadedArtifact(config, step_model, tokenizer, name, directory, load_seconds, manifest=manifest)
