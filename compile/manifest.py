"""Writing an artifact directory: the backend's files and `manifest.json`, atomically.

The manifest itself (its fields, and the checks a runtime makes when it reads one) is
`engine/backends/manifest.py`.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.backends.manifest import (
    MANIFEST_NAME,
    ArtifactError,
    Manifest,
    check_file_names,
    check_no_links_out,
    sha256_file,
)


def sha256_source(path: Path) -> str:
    """One digest for a model source: the file itself, or a directory's files in name order."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    digest = hashlib.sha256()
    for child in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(child.relative_to(path)).encode() + b"\0" + sha256_file(child).encode())
    return digest.hexdigest()


def library_versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("onnx", "onnxruntime", "tensorrt", "triton"):
        try:
            module = __import__(name)
        except Exception:  # absent or broken: the manifest just does not list it
            continue
        versions[name] = str(getattr(module, "__version__", "unknown"))
    return versions


def describe_device(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return {"type": "cuda", "name": torch.cuda.get_device_name(device), "capability": [major, minor]}
    return {"type": device.type, "name": platform.processor() or platform.machine(), "capability": None}


def file_entries(directory: Path) -> dict[str, dict[str, Any]]:
    """Every file under `directory` (its path relative to it) with its sha256 and size."""
    return {str(p.relative_to(directory)): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
            for p in sorted(Path(directory).rglob("*")) if p.is_file()}


def write_artifact(out: Path, manifest: Manifest, fill: Callable[[Path], None]) -> Path:
    """`fill(tmp)` writes the backend's files into a fresh directory beside `out`; the manifest is added
    with every file's digest, and the directory is renamed to `out` only once complete. A manifest whose
    `files` are already listed (the pipeline lists them to load the artifact back before writing it, and
    `fill` then moves those very files) keeps them, once the names are checked to match."""
    out = Path(out).resolve()
    if out.exists():
        raise ArtifactError(f"{out}: already exists; choose another --out or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        fill(tmp)
        if manifest.files:
            names = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
            if names != sorted(manifest.files):
                raise ArtifactError(f"{out}: the files written differ from the manifest's list")
        else:
            manifest.files = file_entries(tmp)
        # What the runtime will check on reading it (engine/backends/manifest.py): no name leads outside.
        check_file_names(tmp, manifest, out / MANIFEST_NAME)
        check_no_links_out(tmp)
        manifest.created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        (tmp / MANIFEST_NAME).write_text(manifest.to_json() + "\n", encoding="utf-8")
        os.rename(tmp, out)  # atomic on one filesystem: readers see no directory or a whole one
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


