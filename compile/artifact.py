"""Loading a compiled artifact as a model the engine serves (`LLM(artifact=...)`, `ladder serve --artifact`)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from compile.manifest import ArtifactError, Manifest, check_device, read_manifest
from model.config import ModelConfig
from model.loader import LoadedModel
from model.tokenizer import Tokenizer

TOKENIZER_DIR = "tokenizer"


def load_backend(directory: Path, manifest: Manifest, device: torch.device):
    """The backend's step model from the files in `directory` (already checked against the manifest)."""
    block_size = manifest.shapes["block_size"]
    if manifest.backend == "torch-compile":
        from compile import torch_backend

        return torch_backend.load(directory, manifest.precision, block_size, device, manifest.backend_options)
    if manifest.backend == "onnx":
        from compile import onnx_backend
        from compile.quantize import activation_dtype

        config = ModelConfig.from_dict(manifest.model["config"])
        providers = ["CPUExecutionProvider"] if device.type == "cpu" else None  # None: CUDA first
        return onnx_backend.OnnxModel.load(directory, config, block_size, activation_dtype(manifest.precision),
                                           providers=providers)
    from compile import tensorrt_backend

    return tensorrt_backend.TensorRTModel.load(directory, manifest, device)


def load_artifact(directory: str | Path, device: str | torch.device | None = None) -> LoadedModel:
    """Check the manifest and every file's sha256, then load; ArtifactError says what does not match."""
    start = time.perf_counter()
    directory = Path(directory).expanduser().resolve()
    manifest = read_manifest(directory)
    device = torch.device(device or manifest.device["type"])
    check_device(manifest, device)
    step_model = load_backend(directory, manifest, device)
    tokenizer_dir = directory / TOKENIZER_DIR
    tokenizer = Tokenizer.from_saved(tokenizer_dir) if tokenizer_dir.is_dir() else None
    config = ModelConfig.from_dict(manifest.model["config"])
    name = manifest.model.get("name") or directory.name
    return LoadedModel(config, step_model, tokenizer, name, directory, time.perf_counter() - start,
                       kv_cache_dtype=step_model.kv_cache_dtype, manifest=manifest)


__all__ = ["ArtifactError", "load_artifact"]
