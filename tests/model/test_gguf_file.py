"""model/gguf_file.py reads what the `gguf` package's own reader reads: every metadata value, and every
tensor's name, type, shape and data, on the default model and on files of each tensor type."""

from __future__ import annotations

import struct

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
