"""An artifact's manifest as the runtime reads it: checked on load, refused with one line.

A manifest says what was built (backend, precision, the shapes it serves), from what (the source model
and its sha256), with what (library versions, device), how well it matches fp32 eager (the parity
report) and how fast it ran (the benchmark figures), and the sha256 and size of every other file in the
directory. Loading refuses a newer format, a missing or changed file, and a device the artifact was
not built for, each with one line that names the problem. `compile/manifest.py` writes it.

Every file name a manifest gives (`files`, `package.file`) is relative to the artifact's directory and
stays inside it: a name that is absolute, has a `..` part, or resolves (through symlinks) outside the
directory is refused when the manifest is read, before any loader opens it; so is a symlink anywhere in
the directory that leads outside it (a loader opens some files by their fixed names).

Format 2 added `package`: a CPU torch-compile artifact's step compiled ahead of time (AOTInductor), with
the torch and CPU it was built for (`engine/backends/aoti_runtime.py` checks them). Format 1 artifacts,
without it, still load: their step is compiled at start-up.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
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


def _resolved(path: Path) -> Path | None:
    """`path` with every symlink followed (None for a symlink loop)."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop (Python < 3.13)
        return None


def artifact_file(directory: Path, name: object, where: Path) -> Path:
    """`directory / name` for a file name the manifest at `where` gives; ArtifactError (one line) for a
    name that could reach outside the directory: absolute, with a `..` part, or resolving there."""
    if not isinstance(name, str) or not name.strip() or "\0" in name:
        raise ArtifactError(f"{where}: {name!r} is not a file name")
    reason = None
    if os.path.isabs(name) or PurePosixPath(name).is_absolute():
        reason = "an absolute path"
    elif ".." in PurePosixPath(name).parts:
        reason = "a '..' part"
    else:
        root = _resolved(Path(directory))
        target = _resolved(Path(directory) / name)
        if root is None or target is None:
            reason = "a symlink loop"
        elif target == root or not target.is_relative_to(root):
            reason = f"it resolves to {target}"
    if reason:
        raise ArtifactError(f"{where}: file {name!r} is outside the artifact directory ({reason}); "
                            "a manifest names only files inside it")
    return Path(directory) / name


def check_file_names(directory: Path, manifest: Manifest, where: Path) -> None:
    """Refuse a manifest whose `files` or `package` is malformed, or names a file outside `directory`."""
    if not isinstance(manifest.files, dict) or not isinstance(manifest.package, dict):
        raise ArtifactError(f"{where}: `files` and `package` must be JSON objects")
    for name, entry in manifest.files.items():
        artifact_file(directory, name, where)
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                and isinstance(entry.get("sha256"), str)):
            raise ArtifactError(f"{where}: file {name!r} has no integer `bytes` and string `sha256`")
    if manifest.package:
        artifact_file(directory, manifest.package.get("file"), where)


def check_no_links_out(directory: Path) -> None:
    """Refuse a symlink anywhere in the artifact directory that leads outside it (loaders open some files
    by fixed names, listed in the manifest or not)."""
    root = _resolved(Path(directory))
    for entry in Path(directory).rglob("*"):  # symlinked directories are listed, not entered
        if entry.is_symlink():
            target = _resolved(entry)
            if root is None or target is None or not target.is_relative_to(root):
                raise ArtifactError(f"{entry}: a symlink out of the artifact directory (to "
                                    f"{target or 'a loop'}); an artifact's files must be inside it")


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
    check_file_names(directory, manifest, path)
    if verify_files:
        check_no_links_out(directory)
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
