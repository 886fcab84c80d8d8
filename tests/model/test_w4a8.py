"""W4A8 at load (`model.load(..., quantization="w4a8")`, `--quantization w4a8`): a GGUF's own blocks (the
legacy types, K-quants, model/gguf_blocks.py) swapped in for every linear layer, tracking the float model the
file dequantizes to, and serving the same greedy tokens batched as alone."""

from __future__ import annotations

import pytest
import torch

import model
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from model.block_quantization import W4A8Linear
from model.default import packaged_model_path
from model.errors import ModelLoadError
from model.sequences import Sequences
from tiny_models import k_quant_model, make_hf_model, write_gguf


def _logits(module, prompts):
    return Sequences(module, len(prompts), 32).step(prompts)


# A Q4_K_M-like mix, each way of reading blocks in one file: Q4_K q, k, gate and down beside a Q6_K v
# (6-bit codes with sub-scales, so the fused qkv widens to 6 bits), a Q5_K o, a Q5_0 up (gate_up widened,
# Q4_K's d and m beside Q5_0's zero of 16), a Q6_K LM head.
K_QUANT_MIX = {"attn_v": "Q6_K", "attn_output": "Q5_K", "ffn_up": "Q5_0", "output": "Q6_K"}
# IQ4 and Q3_K files: IQ4_XS q, k, v and gate beside an IQ4_NL up (one table: table codes), a Q3_K o and down
# (6-bit codes under sub-scales), a Q6_K LM head.
IQ_MIX = {"attn_output": "Q3_K", "ffn_up": "IQ4_NL", "ffn_down": "Q3_K", "output": "Q6_K"}


@pytest.mark.parametrize("family,qtype", [("llama3", "Q4_1"), ("qwen2", "Q8_0"), ("k-quants", "Q4_K"),
                                          ("iq-quants", "IQ4_XS")])
def test_w4a8_tracks_the_float_model_and_is_batch_invariant(tmp_path, family, qtype):
    """llama3: q/k rows reordered from llama.cpp's layout; qwen2: q/k/v biases and a tied (Q8_0) head;
    k-quants: K_QUANT_MIX; iq-quants: IQ_MIX, each linear the file's weights (one-hot rows: Q3_K and IQ4_NL
    exactly, IQ4_XS within its scales' float16 rounding)."""
    if family.endswith("quants"):
        write_gguf(k_quant_model(), tmp_path / "m.gguf", qtype, "llama",
                   qtypes=K_QUANT_MIX if family == "k-quants" else IQ_MIX)
    else:
        hf = make_hf_model(family, tmp_path / "hf")
        write_gguf(hf, tmp_path / "m.gguf", qtype, "llama" if family == "llama3" else family)
    fp32 = model.load(tmp_path / "m.gguf")
    w4a8 = model.load(tmp_path / "m.gguf", quantization="w4a8")
    assert w4a8.quantization == "w4a8"
    linears = [m for m in w4a8.module.modules() if isinstance(m, torch.nn.Linear | W4A8Linear)]
    assert linears and all(isinstance(m, W4A8Linear) for m in linears)
    assert w4a8.module.lm_head.bits == {"Q8_0": 8, "Q4_K": 6, "IQ4_XS": 6}.get(qtype, 4)
    layer = w4a8.module.layers[0]
    if family == "k-quants":
        assert [layer.self_attn.qkv_proj.bits, layer.self_attn.o_proj.bits, layer.mlp.gate_up_proj.bits,
                layer.mlp.down_proj.bits] == [6, 5, 5, 4]
    if family == "iq-quants":  # table codes (7) for q/k/v and gate/up, 6-bit codes for o and down
        assert [layer.self_attn.qkv_proj.bits, layer.self_attn.o_proj.bits, layer.mlp.gate_up_proj.bits,
                layer.mlp.down_proj.bits] == [7, 6, 7, 6]
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            w4a8_layer, dense = layer.get_submodule(name), fp32.module.layers[0].get_submodule(name)
            held = w4a8_layer(torch.eye(dense.in_features)).t()
            if name in ("self_attn.o_proj", "mlp.down_proj"):  # Q3_K: exact
                assert torch.equal(held, dense.weight), name
            else:  # IQ4_XS's scales rounded once to float16 (IQ4_NL's up rows exact)
                assert ((held - dense.weight).abs() <= 2.0**-11 * dense.weight.abs() + 1e-9).all(), name
                rows = dense.out_features // 2
                assert name != "mlp.gate_up_proj" or torch.equal(held[rows:], dense.weight[rows:])
    prompts = [[5, 9, 30, 31, 2, 17, 40], [7, 7, 8, 100, 250, 3, 4]]
    reference, logits = _logits(fp32.module, prompts), _logits(w4a8.module, prompts)
    assert ((logits - reference).norm() / reference.norm()).item() < 0.05
    if not family.endswith("quants"):  # random blocks give flat logits: a near tie (0.09 of a spread of 3.9) flips
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
    with pytest.raises(ModelLoadError, match="linear weights are F32; the w4a8 layers take a quantized file's"):
        model.load(tmp_path / "f32.gguf", quantization="w4a8")
    # A float output beside quantized layers is requantized to 8 bits, as llama.cpp's 16-bit-output files need.
    write_gguf(hf, tmp_path / "f32_head.gguf", "Q4_0", qtypes={"output": "F32"})
    mixed = model.load(tmp_path / "f32_head.gguf", quantization="w4a8")
    assert (mixed.module.lm_head.bits, mixed.module.layers[0].mlp.down_proj.bits) == (8, 4)
    prompts = [[5, 9, 30, 31, 2, 17, 40]]
    reference = _logits(model.load(tmp_path / "f32_head.gguf").module, prompts)
    assert ((_logits(mixed.module, prompts) - reference).norm() / reference.norm()).item() < 0.05
    with pytest.raises(ModelLoadError, match="GGUF file's own blocks, or MXFP4 experts") as error:
        model.load(tmp_path / "hf", quantization="w4a8")  # a directory without MXFP4 experts
    assert "\n" not in str(error.value)
    # `auto` takes W4A8 only where it applies, W8A8 elsewhere (on a CPU with the int8 kernels' VNNI tiles).
    from model import quantization
    from model.quantization import resolve_quantization

    monkeypatch.setattr(quantization, "int8_kernels_are_fast", lambda: True)

    import gguf

    from model.gguf_checkpoint import tensor_types

    write_gguf(hf, tmp_path / "q4.gguf", "Q4_1")
    assert resolve_quantization("auto", "float32", "cpu", tmp_path / "q4.gguf") == "w4a8"
    assert resolve_quantization("auto", "float32", "cpu", tmp_path / "f32.gguf") == "w8a8"
    # Where W4A8 reads fewer bytes a step than W8A8: mostly 4-bit codes, not 8-bit ones with their scales.
    k_quants = k_quant_model()
    write_gguf(k_quants, tmp_path / "q4_k_m.gguf", "Q4_K", qtypes={"attn_v": "Q6_K", "output": "Q6_K"})
    write_gguf(k_quants, tmp_path / "mix.gguf", "Q4_K", qtypes=K_QUANT_MIX)  # 6-bit q/k/v, 5-bit o, gate/up
    write_gguf(hf, tmp_path / "q8.gguf", "Q8_0")
    write_gguf(hf, tmp_path / "q5.gguf", "Q5_0", qtypes={"output": "Q8_0"})  # Gemma 3 270M's kind of file
    for name in ("q4_k_m.gguf", "f32_head.gguf", "mix.gguf", "q5.gguf"):
        assert resolve_quantization("auto", "float32", "cpu", tmp_path / name) == "w4a8", name
    assert resolve_quantization("auto", "float32", "cpu", tmp_path / "q8.gguf") == "w8a8"
    # A Q6_K file's 6-bit codes and sub-scales read 0.87x W8A8's bytes: not enough for their float work.
    write_gguf(k_quants, tmp_path / "q6_k.gguf", "Q6_K")
    assert resolve_quantization("auto", "float32", "cpu", tmp_path / "q6_k.gguf") == "w8a8"
    # Fewer bytes, but not 10% fewer: Gemma 3 270M's file (its Q8_0 LM head most of its bytes) stays W8A8,
    # where it decodes faster.
    from model.gguf_checkpoint import linear_bytes

    w4a8_bytes, w8a8_bytes = linear_bytes(packaged_model_path("gemma-3-270m"))
    assert quantization.W4A8_BYTES_AT_MOST < w4a8_bytes / w8a8_bytes < 1
    assert resolve_quantization("auto", "float32", "cpu", "gemma-3-270m") == "w8a8"
    for name in ("q4.gguf", "f32.gguf"):  # the header scan `auto` uses reads what gguf's reader reads
        path = tmp_path / name
        assert tensor_types(path) == {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "q4.gguf").read_bytes()[:300])  # a truncated header
    assert resolve_quantization("auto", "float32", "cpu", tmp_path / "cut.gguf") == "w8a8"
    with pytest.raises(ValueError, match="w4a8 is a CPU kernel"):  # no CUDA path: refused in one line
        resolve_quantization("w4a8", "float32", "cuda")


@pytest.mark.parametrize("family,arch,qtype", [("qwen3_moe", "qwen3moe", "Q4_1"), ("mixtral", "llama", "Q8_0")])
def test_w4a8_experts_track_the_float_experts(tmp_path, family, arch, qtype):
    """A mixture-of-experts GGUF in W4A8: every sparse layer's experts on the file's blocks (the router
    float), each block within int8 activations' rounding of the float block on the same rows; Qwen3-MoE's
    dense middle layer a W4A8 MLP; the same greedy tokens batched as alone; and `auto` picks it."""
    from model.moe import W4A8SparseMoeBlock
    from model.quantization import resolve_quantization

    write_gguf(make_hf_model(family, tmp_path / "hf"), tmp_path / "m.gguf", qtype, arch)
    fp32 = model.load(tmp_path / "m.gguf")
    w4a8 = model.load(tmp_path / "m.gguf", quantization="w4a8")
    config = w4a8.config
    sparse = [i for i in range(config.num_layers) if config.is_sparse_layer(i)]
    assert len(sparse) == (2 if family == "qwen3_moe" else config.num_layers)
    torch.manual_seed(0)
    x = torch.randn(16, config.hidden_size)
    for i, layer in enumerate(w4a8.module.layers):
        if i not in sparse:
            assert isinstance(layer.mlp.gate_up_proj, W4A8Linear)
            continue
        assert isinstance(layer.mlp, W4A8SparseMoeBlock) and layer.mlp.w13_bits == (4 if qtype == "Q4_1" else 8)
        assert torch.equal(layer.mlp.gate.weight, fp32.module.layers[i].mlp.gate.weight)  # the router as read
        reference = fp32.module.layers[i].mlp(x)
        assert ((layer.mlp(x) - reference).norm() / reference.norm()).item() < 0.03
    llm = LLM(loaded=w4a8, kv_cache_memory_gib=0.01)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    batch = [[5, 9, 30, 31], [7, 7, 8, 100, 250, 3], [40, 2]]
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in batch]
    assert [r.outputs[0].token_ids for r in llm.generate(batch, params)] == alone
    assert w4a8.module.cpu_step_reason is None  # the layers, experts too, ran as one C++ call
    assert resolve_quantization("auto", "float32", "cpu", tmp_path / "m.gguf") == "w4a8"  # not float32
