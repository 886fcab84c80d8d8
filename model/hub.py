"""Models by name: `org/name` from the Hugging Face hub, through its cache.

A source that is not a local path and reads `org/name` (optionally `org/name:file.gguf` for one GGUF file of
a repository) is fetched with `huggingface_hub.snapshot_download` into the hub cache (`download_dir`, else
$HF_HUB_CACHE / $HF_HOME as huggingface_hub reads them), at `revision` (a branch, tag or commit; default
main), and loaded from the snapshot directory like any local one. Only what ladder reads is fetched:
config and tokenizer files, safetensors weights and generation_config.json (or the one GGUF file), never
pickled weights. With HF_HUB_OFFLINE set, nothing is downloaded: the name must already be in the cache.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from model.errors import ModelLoadError, one_line

# org/name, then optionally :file.gguf; the characters the hub allows in ids.
REPO_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<file>[\w./-]+\.gguf))?$")
DIRECTORY_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja"]


def is_repo_id(source: str) -> bool:
    """Whether `source` names a hub model (and is not a local path)."""
    return not Path(source).expanduser().exists() and REPO_ID.match(source) is not None


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def fetch(source: str, revision: str | None = None, download_dir: str | Path | None = None) -> Path:
    """The local path of hub model `source` (a snapshot directory, or the GGUF file in it), downloaded
    into the cache unless it is there (or HF_HUB_OFFLINE is set); ModelLoadError in one line otherwise."""
    match = REPO_ID.match(source)
    if match is None:
        raise ModelLoadError(f"{source}: not a hub model name (org/name or org/name:file.gguf)")
    repo, gguf_file = match["repo"], match["file"]
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelLoadError(f"{source}: models by name need huggingface_hub (pip install huggingface_hub)") from None
    try:
        snapshot = snapshot_download(repo, revision=revision, cache_dir=download_dir, local_files_only=offline(),
                                     allow_patterns=[gguf_file] if gguf_file else DIRECTORY_FILES)
    except Exception as error:  # noqa: BLE001  the hub's errors are many; each becomes the one line
        where = f" at revision {revision}" if revision else ""
        if offline():
            raise ModelLoadError(f"{source}{where}: not in the hub cache, and HF_HUB_OFFLINE is set "
                                 f"({type(error).__name__})") from None
        raise ModelLoadError(f"{source}{where}: cannot fetch it from the hub ({type(error).__name__}: "
                             f"{one_line(error)})") from None
    path = Path(snapshot) / gguf_file if gguf_file else Path(snapshot)
    if gguf_file and not path.is_file():
        raise ModelLoadError(f"{source}: the repository has no {gguf_file}")
    if not gguf_file and not (path / "config.json").is_file():
        raise ModelLoadError(f"{source}: the snapshot has no config.json (for a GGUF file of the repository, "
                             f"name it: {repo}:FILE.gguf)")
    return path
