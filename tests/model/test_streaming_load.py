"""Loading builds the module tensor by tensor: a GGUF file's tensors are dequantized one at a time as the
module takes them (never a whole dequantized copy beside the module), and under w4a8 the float linears
the file's blocks replace are never dequantized at all."""

from __future__ import annotations

import weakref

import pytest
import torch

import model
from model.gguf_checkpoint import GGUFCheckpoint
from model.weights import LazyTensors, build_model, expected_shapes, fused_sources
from tiny_models import make_hf_model, write_gguf


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory):
    """llama3 (q/k rows reordered from llama.cpp's layout, an untied head) as Q4_1, and its float tensors."""
    directory = tmp_path_factory.mktemp("stream")
    hf = make_hf_model("llama3", directory / "hf")
    held = write_gguf(hf, directory / "m.gguf", "Q4_1")
    return directory / "m.gguf", held


class CountingReads:
    """Wraps `GGUFCheckpoint._read_tensor`: every read by name, and the bytes of read tensors still alive."""

    def __init__(self, monkeypatch) -> None:
        self.names: list[str] = []
        self.alive = self.peak_alive = 0
        read = GGUFCheckpoint._read_tensor

        def counting(checkpoint, name, tensor):
            result = read(checkpoint, name, tensor)
            self.names.append(name)
            self.alive += result.nbytes
            self.peak_alive = max(self.peak_alive, self.alive)
            weakref.finalize(result, self._freed, result.nbytes)
            return result

        monkeypatch.setattr(GGUFCheckpoint, "_read_tensor", counting)

    def _freed(self, nbytes: int) -> None:
        self.alive -= nbytes


def test_lazy_tensors_know_their_shapes_without_reading(q4_gguf, monkeypatch):
    path, held = q4_gguf
    reads = CountingReads(monkeypatch)
    tensors = GGUFCheckpoint(path).read_tensors()
    assert isinstance(tensors, LazyTensors)
    assert all(name in tensors for name in expected_shapes(GGUFCheckpoint(path).config))
    assert "layers.99.mlp.up_proj.weight" not in tensors
    assert reads.names == []
    for name in tensors:  # the header's shapes are the dequantized tensors', and the values the file's
        assert tensors.shapes[name] == tuple(tensors[name].shape)
        if name.endswith(("q_proj.weight", "k_proj.weight", "up_proj.weight")):
            torch.testing.assert_close(tensors[name], held["model." + name], rtol=0, atol=0)


def test_build_reads_each_tensor_once_and_keeps_one_at_a_time(q4_gguf, monkeypatch):
    path, _ = q4_gguf
    checkpoint = GGUFCheckpoint(path)
    eager = dict(checkpoint.read_tensors())  # the whole model read first, as loading did before
    reference = build_model(checkpoint.config, eager, str(path), "metadata", torch.bfloat16)
    del eager
    reads = CountingReads(monkeypatch)
    streamed = build_model(checkpoint.config, checkpoint.read_tensors(), str(path), "metadata", torch.bfloat16)
    assert sorted(reads.names) == sorted(expected_shapes(checkpoint.config))  # each once
    # Cast to bfloat16, every float32 source is freed once the module holds its copy: at most one module
    # tensor's parts (q, k and v, say) are alive at once, never the whole model.
    shapes = expected_shapes(checkpoint.config)
    nbytes = {name: torch.Size(shape).numel() * 4 for name, shape in shapes.items()}
    largest = max(sum(nbytes[part] for part in parts) for parts in fused_sources(checkpoint.config).values())
    assert reads.peak_alive <= largest < sum(nbytes.values()) / 4
    assert reads.alive == 0
    assert streamed.state_dict().keys() == reference.state_dict().keys()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(streamed.state_dict()[name], tensor), name
    assert all(not p.is_meta and p.dtype == torch.bfloat16 for p in streamed.parameters())


def test_w4a8_never_dequantizes_the_linears(q4_gguf, monkeypatch):
    path, _ = q4_gguf
    reads = CountingReads(monkeypatch)
    loaded = model.load(path, quantization="w4a8")
    assert reads.names and not any(name.endswith("_proj.weight") or name == "lm_head.weight" for name in reads.names)
    assert not any(t.is_meta for t in [*loaded.module.parameters(), *loaded.module.buffers()])


def test_load_resolves_auto_dtype(tiny_hf_dir):
    loaded = model.load(tiny_hf_dir("llama3"), dtype="auto")
    assert loaded.module.embed_tokens.weight.dtype == torch.float32  # on a CPU


def test_a_hugging_face_directory_is_read_tensor_by_tensor(tiny_hf_dir):
    """Shapes come from the headers; each tensor is read when asked for, so loading never holds the whole
    checkpoint beside the module being built (Gemma 3 270M in float32: peak RSS 672 MiB against 911)."""
    from model.hf_checkpoint import read_tensors, safetensors_files
    from model.weights import LazyTensors

    directory = tiny_hf_dir("llama3")
    tensors = read_tensors(safetensors_files(directory))
    assert isinstance(tensors, LazyTensors)
    name = "layers.0.self_attn.q_proj.weight"
    assert tensors.shapes[name] == (64, 64)
    first, second = tensors[name], tensors[name]
    assert torch.equal(first, second) and first.data_ptr() != second.data_ptr()  # made afresh, not kept
