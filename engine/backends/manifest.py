"""An artifact's manifest as the runtime reads it: checked on load, refused with one line.

A manifest says what was built (backend, precision, the shapes it serves), from what (the source model
and its sha256), with what (library versions, device), how well it matches fp32 eager (the parity
report) and how fast it ran (the benchmark figures), and the sha256 and size of every other file in the
directory. Loading refuses a newer format, a missing or changed file, and a device the artifact was
not built for, each with one line that names the problem. `compile/manifest.py` writes it.

Format 2 added `package`: a CPU torch-compile artifact's step compiled ahead of time (AOTInductor), with
the torch and CPU it was built for (`engine/backends/aoti_runtime.py` checks them). Format 1 artifacts,
without it, still load: their step is compiled at start-up.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from model.precision import COMPILE_PRECISIONS

FORMAT_VERSION = 2
MANIFEST_NAME = "manifest.json"
BACKENDS = ("torch-compile", "onnx", "tensorrt")


class ArtifactError(Exception):
    """An artifact that cannot be used as it is; the message is one line naming the file or field."""


@dataclass
class Manifest:
    backend: str
    precision: str
    model: dict[str, Any]  # name, source path, sha256 of the source file(s), its config
    shapes: dict[str, int]  # max_num_seqs, max_model_len, block_size
    device: dict[str, Any]  # type, name, compute capability (CUDA)
    libraries: dict[str, str]
    backend_options: dict[str, Any] = field(default_factory=dict)  # what rebuilds the same module
    quantization: dict[str, Any] = field(default_factory=dict)  # how weights were changed (w8a8: calibration)
    parity: dict[str, Any] = field(default_factory=dict)
    bench: dict[str, Any] = field(default_factory=dict)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {sha256, bytes}
    # The step compiled ahead of time: {file, kind, torch, machine, cpu_capability, cpu_flags}; empty: none.
    package: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    created: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(directory: Path, verify_files: bool = True) -> Manifest:
    """The checked manifest of an artifact directory, or ArtifactError saying what is wrong."""
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    if not directory.is_dir():
        raise ArtifactError(f"{directory}: no such artifact directory")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ArtifactError(f"{path}: missing; not an artifact directory (run `ladder compile` first)") from None
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{path}: cannot read: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("format_version"), int):
        raise ArtifactError(f"{path}: no integer format_version")
    if data["format_version"] > FORMAT_VERSION:
        raise ArtifactError(f"{path}: format version {data['format_version']} is newer than this ladder "
                            f"reads ({FORMAT_VERSION}); upgrade ladder or recompile")
    try:
        manifest = Manifest(**data)
    except TypeError as exc:
        raise ArtifactError(f"{path}: unexpected fields: {exc}") from exc
    if manifest.backend not in BACKENDS or manifest.precision not in COMPILE_PRECISIONS:
        raise ArtifactError(f"{path}: unknown backend {manifest.backend!r} or precision {manifest.precision!r}")
    if verify_files:
        for name, entry in manifest.files.items():
            file = directory / name
            if not file.is_file():
                raise ArtifactError(f"{file}: listed in the manifest but missing")
            if file.stat().st_size != entry["bytes"]:
                raise ArtifactError(f"{file}: {file.stat().st_size} bytes, the manifest says {entry['bytes']}")
            if sha256_file(file) != entry["sha256"]:
                raise ArtifactError(f"{file}: sha256 does not match the manifest (the file changed)")
    return manifest


def check_device(manifest: Manifest, device: torch.device) -> None:
    """Refuse a device the artifact was not built for (CPU artifacts run on any CPU)."""
    built = manifest.device.get("type")
    if built != device.type:
        raise ArtifactError(f"artifact built for {built}, asked to run on {device.type}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ArtifactError("artifact built for CUDA but no CUDA device is available")
        have = list(torch.cuda.get_device_capability(device))
        if manifest.device.get("capability") and have != list(manifest.device["capability"]):
            raise ArtifactError(f"artifact built for compute capability {manifest.device['capability']}, "
                                f"this GPU has {have}")
