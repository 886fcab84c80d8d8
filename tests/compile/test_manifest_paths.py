"""An artifact's manifest names files only inside its directory: an absolute name, a `..` part, or a name
(or any other file) that resolves through a symlink outside the directory is refused with one line when
the manifest is read, before any loader opens it. The artifact here is written by hand (the manifest,
two small files, `compile/manifest.write_artifact` as `ladder compile` writes one), so the checks run in
well under a second; the real artifacts' loading is tests/compile/test_compile.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compile.manifest import write_artifact
from engine.backends import artifact as artifact_module
from engine.backends.artifact import LoadedArtifact, load_artifact
from engine.backends.manifest import MANIFEST_NAME, ArtifactError, Manifest, read_manifest, sha256_file
from model.config import ModelConfig

OUTSIDE = "outside the artifact directory"
CONFIG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=8, intermediate_size=16, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=128, tie_word_embeddings=True)


@pytest.fixture
def art(tmp_path) -> Path:
    """A small CPU ONNX artifact as `ladder compile` writes its directory: a graph file and a file in a
    subdirectory, each listed with its sha256."""
    manifest = Manifest(backend="onnx", precision="fp32", model={"name": "probe", "config": CONFIG.to_dict()},
                        shapes={"max_num_seqs": 2, "max_model_len": 64, "block_size": 16},
                        device={"type": "cpu", "name": "cpu", "capability": None}, libraries={})

    def fill(directory: Path) -> None:
        (directory / "model.onnx").write_bytes(b"graph")
        (directory / "weights").mkdir()
        (directory / "weights" / "part.bin").write_bytes(b"weights")

    return write_artifact(tmp_path / "art", manifest, fill)


def _edit(art: Path, **changes) -> None:
    data = json.loads((art / MANIFEST_NAME).read_text())
    data.update(changes)
    (art / MANIFEST_NAME).write_text(json.dumps(data))


def _entry(path: Path) -> dict:
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size}


def _outside_file(art: Path) -> Path:
    """A file beside the artifact, with the very bytes of its graph (so only its place is wrong)."""
    outside = art.parent / "elsewhere" / "x.onnx"
    outside.parent.mkdir()
    outside.write_bytes((art / "model.onnx").read_bytes())
    return outside


def test_a_normal_artifact_loads(art, monkeypatch):
    manifest = read_manifest(art)
    assert sorted(manifest.files) == ["model.onnx", "weights/part.bin"]
    # Every check load_artifact makes, with the backend's own loading stubbed (it is not what is tested).
    monkeypatch.setattr(artifact_module, "load_backend", lambda directory, manifest, device: "step model")
    loaded = load_artifact(art)
    assert isinstance(loaded, LoadedArtifact) and loaded.module == "step model"
    assert loaded.path == art.resolve() and loaded.config == CONFIG


def test_a_link_inside_the_directory_is_accepted(art):
    (art / "weights" / "part.bin").rename(art / "weights" / "real.bin")
    (art / "weights" / "part.bin").symlink_to("real.bin")
    files = json.loads((art / MANIFEST_NAME).read_text())["files"]
    _edit(art, files={**files, "weights/real.bin": files["weights/part.bin"]})
    assert "weights/part.bin" in read_manifest(art).files


@pytest.mark.parametrize("verify_files", [True, False])
def test_an_absolute_name_is_refused(art, verify_files):
    outside = _outside_file(art)
    _edit(art, files={str(outside): _entry(outside)})
    with pytest.raises(ArtifactError, match=rf"{OUTSIDE} \(an absolute path\)"):
        read_manifest(art, verify_files=verify_files)


@pytest.mark.parametrize("name", ["../elsewhere/x.onnx", "weights/../../elsewhere/x.onnx", "../../etc/passwd"])
def test_a_name_with_dot_dot_is_refused(art, name):
    outside = _outside_file(art)
    _edit(art, files={name: _entry(outside)})
    with pytest.raises(ArtifactError, match=rf"{OUTSIDE} \(a '\.\.' part\)"):
        load_artifact(art)


def test_a_listed_symlink_out_of_the_directory_is_refused(art):
    outside = _outside_file(art)  # the same bytes: the sha256 check alone would pass it
    (art / "model.onnx").unlink()
    (art / "model.onnx").symlink_to(outside)
    with pytest.raises(ArtifactError, match=rf"'model\.onnx' is {OUTSIDE} \(it resolves to {outside}\)"):
        load_artifact(art)


def test_a_symlinked_subdirectory_out_of_the_directory_is_refused(art):
    moved = art.parent / "elsewhere"
    (art / "weights").rename(moved)
    (art / "weights").symlink_to(moved)
    with pytest.raises(ArtifactError, match=rf"'weights/part\.bin' is {OUTSIDE}"):
        read_manifest(art, verify_files=False)


def test_an_unlisted_symlink_out_of_the_directory_is_refused(art):
    # Not in the manifest, but a loader opens some files by their fixed names (model.safetensors, ...).
    (art / "model.safetensors").symlink_to(_outside_file(art))
    with pytest.raises(ArtifactError, match="a symlink out of the artifact directory"):
        load_artifact(art)


def test_a_compiled_step_outside_the_directory_is_refused(art):
    _edit(art, package={"file": "../elsewhere/step.pt2", "kind": "aotinductor"})
    with pytest.raises(ArtifactError, match=rf"'\.\./elsewhere/step\.pt2' is {OUTSIDE}"):
        read_manifest(art, verify_files=False)


@pytest.mark.parametrize("files", [{"model.onnx": "abc"}, {"": {"sha256": "0", "bytes": 1}}, ["model.onnx"]])
def test_a_malformed_file_list_is_refused(art, files):
    _edit(art, files=files)
    with pytest.raises(ArtifactError):
        read_manifest(art)


def test_write_artifact_refuses_a_link_out(tmp_path):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"x")
    manifest = Manifest(backend="onnx", precision="fp32", model={}, shapes={}, device={"type": "cpu"}, libraries={})
    with pytest.raises(ArtifactError, match=OUTSIDE):
        write_artifact(tmp_path / "art", manifest, lambda directory: (directory / "x.bin").symlink_to(outside))
    assert not (tmp_path / "art").exists()


def test_serve_refuses_a_name_outside_with_one_line(art):
    _edit(art, files={"../../etc/passwd": {"sha256": "0" * 64, "bytes": 1}})
    env = {**os.environ, "LADDER_CPU_KERNELS": "0"}
    result = subprocess.run([sys.executable, "-m", "ladder.cli", "serve", "--artifact", str(art), "--port", "0"],
                            capture_output=True, text=True, timeout=120, env=env, check=False,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ladder serve: error: ") and OUTSIDE in lines[0], lines
