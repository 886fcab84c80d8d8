"""Models by name (model/hub.py): `org/name` resolved through a Hugging Face hub cache that the test builds,
with HF_HUB_OFFLINE set (no network here or in CI): the default revision and another one, a GGUF file of a
repository, and one-line errors for a name the cache does not hold."""

from __future__ import annotations

import json
import shutil

import pytest

from engine import EngineConfig, LLMEngine
from ladder.cli import main as ladder_main
from model.errors import ModelLoadError
from model.loader import load


def snapshot(cache, repo: str, ref: str, commit: str, files) -> None:
    """The hub cache layout: models--org--name/snapshots/<commit>/..., refs/<ref> holding the commit."""
    root = cache / f"models--{repo.replace('/', '--')}"
    target = root / "snapshots" / commit
    target.mkdir(parents=True)
    for source in files:
        shutil.copy(source, target / source.name)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(commit)


@pytest.fixture(scope="module")
def cache(tiny_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("hub-cache")
    files = [p for p in tiny_dir.iterdir() if p.is_file()]
    snapshot(cache, "acme/tiny-chat", "main", "a" * 40, files)
    # Revision v2: the same weights with a generation_config.json.
    v2 = tmp_path_factory.mktemp("v2")
    (v2 / "generation_config.json").write_text(json.dumps({"temperature": 0.25}))
    snapshot(cache, "acme/tiny-chat", "v2", "b" * 40, [*files, v2 / "generation_config.json"])
    return cache


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_a_model_by_name_loads_from_the_cache_at_its_revision(cache):
    main = load("acme/tiny-chat", download_dir=cache)
    assert main.name == "acme/tiny-chat" and main.path.name == "a" * 40 and main.sampling_defaults == {}
    v2 = load("acme/tiny-chat", revision="v2", download_dir=cache)
    assert v2.path.name == "b" * 40 and v2.sampling_defaults == {"temperature": 0.25}
    engine = LLMEngine(EngineConfig(model="acme/tiny-chat", revision="v2", download_dir=str(cache),
                                    kv_cache_memory_gib=0.01, max_model_len=64))
    assert engine.sampling_defaults == {"temperature": 0.25}


def test_a_gguf_file_of_a_repository(cache):
    from model.default import default_model_path

    snapshot(cache, "acme/smol-gguf", "main", "c" * 40, [default_model_path()])
    name = f"acme/smol-gguf:{default_model_path().name}"
    config = EngineConfig(model=name, download_dir=str(cache))
    assert config.quantization in ("w4a8", "none")  # auto read the fetched file's blocks (none without int8 tiles)
    loaded = load(name, download_dir=cache)
    assert loaded.path == cache / "models--acme--smol-gguf" / "snapshots" / ("c" * 40) / default_model_path().name


def test_names_the_cache_lacks_fail_in_one_line(cache, capsys):
    with pytest.raises(ModelLoadError, match="not in the hub cache, and HF_HUB_OFFLINE is set"):
        load("acme/missing", download_dir=cache)
    with pytest.raises(ModelLoadError, match="at revision v9"):
        load("acme/tiny-chat", revision="v9", download_dir=cache)
    assert ladder_main(["pull", "acme/missing", "--download-dir", str(cache)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "acme/missing" in err[0]
    assert ladder_main(["pull", "acme/tiny-chat", "--download-dir", str(cache)]) == 0
    assert capsys.readouterr().out.strip().endswith("a" * 40)
