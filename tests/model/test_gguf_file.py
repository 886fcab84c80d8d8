"""model/gguf_file.py reads what the `gguf` package's own reader reads: every metadata value, and every
tensor's name, type, shape and data, on the default model and on files of each tensor type."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from model.default import default_model_path
from model.gguf_file import GGUFFile
from tiny_models import hf_config, write_gguf


def assert_reads_alike(path) -> None:
    ours = GGUFFile(path)
    reference = gguf.GGUFReader(str(path))
    expected = {key: field.contents() for key, field in reference.fields.items() if not key.startswith("GGUF.")}
    assert ours.metadata == expected
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        assert mine.tensor_type == theirs.tensor_type
        assert mine.shape == tuple(int(d) for d in theirs.shape)
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, np.asarray(theirs.data))


def test_default_model_reads_alike():
    assert_reads_alike(default_model_path())


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_1", "Q4_K", "Q6_K"])
def test_each_tensor_type_reads_alike(tmp_path, qtype):
    cfg = hf_config("gemma3")
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = 256, 512, 64  # K-quants need rows of 256
    torch.manual_seed(0)
    write_gguf(transformers.AutoModelForCausalLM.from_config(cfg), tmp_path / "m.gguf", qtype, "gemma3")
    assert_reads_alike(tmp_path / "m.gguf")


@pytest.mark.parametrize("cut", [10, 200, -1])
def test_a_file_cut_short_is_refused(tmp_path, cut):
    data = default_model_path().read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:cut] if cut > 0 else data[: len(data) // 2])
    with pytest.raises((ValueError, struct.error)):
        GGUFFile(tmp_path / "cut.gguf")


def test_released_pages_read_back_the_same(tmp_path):
    """After `release_pages` (the loader's, once a model is built) the map's pages leave the process's resident
    memory and every tensor still reads as before: the file's pages fault back in."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config("llama3")).eval()
    path = tmp_path / "m.gguf"
    write_gguf(hf, path, "Q8_0")
    reader = GGUFFile(path)
    before = {t.name: np.array(t.data) for t in reader.tensors}
    assert mapped_kb(path) > 100  # every page read
    reader.release_pages()
    assert mapped_kb(path) < 8
    assert all(np.array_equal(np.array(t.data), before[t.name]) for t in reader.tensors)


def mapped_kb(path) -> int:
    """This process's resident kB of its maps of `path` (Linux's /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0]:  # a mapping's header line
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total
