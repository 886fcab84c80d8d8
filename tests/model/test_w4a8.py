"""W4A8 at load (`model.load(..., quantization="w4a8")`, `--quantization w4a8`): a GGUF's own Q4_0, Q4_1
and Q8_0 blocks swapped in for every linear layer, tracking the float model the file dequantizes to, and
serving the same greedy tokens batched as alone."""

from __future__ import annotations

import pytest
import torch

import model
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from model.block_quantization import W4A8Linear
from model.errors import ModelLoadError
from model.sequences import Sequences
from tiny_models import make_hf_model, write_gguf


def _logits(module, prompts):
    return Sequences(module, len(prompts), 32).step(prompts)


@pytest.mark.parametrize("family,qtype", [("llama3", "Q4_1"), ("qwen2", "Q8_0")])
def test_w4a8_tracks_the_float_model_and_is_batch_invariant(tmp_path, family, qtype):
    """llama3: q/k rows reordered from llama.cpp's layout; qwen2: q/k/v biases and a tied (Q8_0) head."""
    hf = make_hf_model(family, tmp_path / "hf")
    write_gguf(hf, tmp_path / "m.gguf", qtype, "llama" if family == "llama3" else family)
    fp32 = model.load(tmp_path / "m.gguf")
    w4a8 = model.load(tmp_path / "m.gguf", quantization="w4a8")
    assert w4a8.quantization == "w4a8"
    linears = [m for m in w4a8.module.modules() if isinstance(m, torch.nn.Linear | W4A8Linear)]
    assert linears and all(isinstance(m, W4A8Linear) for m in linears)
    assert w4a8.module.lm_head.bits == (8 if qtype == "Q8_0" else 4)
    prompts = [[5, 9, 30, 31, 2, 17, 40], [7, 7, 8, 100, 250, 3, 4]]
    reference, logits = _logits(fp32.module, prompts), _logits(w4a8.module, prompts)
    assert ((logits - reference).norm() / reference.norm()).item() < 0.05
    assert (logits.argmax(-1) == reference.argmax(-1)).all()
    llm = LLM(loaded=w4a8, kv_cache_memory_gib=0.01)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    batch = [[5, 9, 30, 31], [7, 7, 8, 100, 250, 3], [40, 2]]
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in batch]
    together = [r.outputs[0].token_ids for r in llm.generate(batch, params)]
    assert together == alone


def test_w4a8_needs_block_weights(tmp_path, monkeypatch):
    hf = make_hf_model("llama3", tmp_path / "hf")
    write_gguf(hf, tmp_path / "f32.gguf", "F32")
    with pytest.raises(ModelLoadError, match="is F32; the w4a8 layers take Q4_0, Q4_1, Q8_0"):
        model.load(tmp_path / "f32.gguf", quantization="w4a8")
    with pytest.raises(ValueError, match="GGUF file's own 4-bit blocks"):
        model.load(tmp_path / "hf", quantization="w4a8")
    # `auto` takes W4A8 only where it applies, W8A8 elsewhere (on a CPU with the int8 kernels' VNNI tiles).
    from model import quantization
    from model.quantization import resolve_quantization

    monkeypatch.setattr(quantization, "int8_kernels_are_fast", lambda: True)

    import gguf

    from model.gguf_checkpoint import tensor_types

    write_gguf(hf, tmp_path / "q4.gguf", "Q4_1")
    assert resolve_quantization("auto", "float32", "cpu", tmp_path / "q4.gguf") == "w4a8"
    assert resolve_quantization("auto", "float32", "cpu", tmp_path / "f32.gguf") == "w8a8"
    for name in ("q4.gguf", "f32.gguf"):  # the header scan `auto` uses reads what gguf's reader reads
        path = tmp_path / name
        assert tensor_types(path) == {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "q4.gguf").read_bytes()[:300])  # a truncated header
    assert resolve_quantization("auto", "float32", "cpu", tmp_path / "cut.gguf") == "w8a8"
    with pytest.raises(ValueError, match="w4a8 is a CPU kernel"):  # no CUDA path: refused in one line
        resolve_quantization("w4a8", "float32", "cuda")
