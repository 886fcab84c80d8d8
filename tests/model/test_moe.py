"""Mixture-of-experts decoders (Qwen3-MoE, Mixtral): their configs, checkpoint layouts, quantization and
engine. Logits, greedy tokens and mixed flat batches against transformers are tests/model/test_model_parity.py's,
for these families as for the dense ones."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import model
from model.config import ModelConfig
from model.errors import ModelLoadError
from model.generator import Generator
from model.moe import SparseMoeBlock, is_moe_checkpoint
from tiny_models import MOE_FAMILIES, make_hf_model


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_models(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param, directory)
    return request.param, hf, model.load(directory), directory


def test_config_maps_from_hf_fields(moe_models):
    family, _, ours, _ = moe_models
    cfg = ours.config
    assert cfg.architecture == family
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.qk_norm == (family == "qwen3_moe")
    assert cfg.norm_topk_prob == (family == "mixtral")  # the tiny Qwen3-MoE keeps transformers' default, False
    assert cfg.dense_layers == ((1,) if family == "qwen3_moe" else ())
    layers = ours.module.layers
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == [cfg.is_sparse_layer(i)
                                                                          for i in range(cfg.num_layers)]
    assert layers[0].mlp.w13.shape == (8, 64, 64) and layers[0].mlp.w2.shape == (8, 64, 32)


def test_config_round_trips_through_json(moe_models):
    cfg = moe_models[2].config
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_qwen3_moe_sparse_step_maps_to_dense_layers():
    raw = {"model_type": "qwen3_moe", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
           "num_hidden_layers": 6, "num_attention_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 8, "decoder_sparse_step": 2, "mlp_only_layers": [5], "norm_topk_prob": True}
    cfg = ModelConfig.from_hf(raw)
    assert cfg.dense_layers == (0, 2, 4, 5) and cfg.norm_topk_prob
    with pytest.raises(ValueError, match="need experts"):
        cfg.replace(num_experts=0)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        cfg.replace(num_experts_per_tok=5)


def test_engine_generates_as_the_generator_does(moe_models):
    from engine import LLM, SamplingParams

    _, _, ours, directory = moe_models
    # `auto` keeps a mixture-of-experts checkpoint in float32 (the int8 schemes do not cover experts).
    llm = LLM(str(directory), quantization="auto", kv_cache_memory_gib=0.02, max_model_len=256, max_num_seqs=4)
    assert llm.engine.config.quantization == "none"
    prompts = [prompt(9 + 5 * i, seed=20 + i) for i in range(3)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for ids, out in zip(prompts, outs, strict=True):
        expected = [s.token_id for s in Generator(ours.module, 64).generate(ids, 8)]
        assert list(out.outputs[0].token_ids) == expected


def test_lora_on_experts_is_refused_in_one_line(moe_models):
    from engine import LLM

    _, _, _, directory = moe_models
    with pytest.raises(ValueError, match="LoRA adapters need dense MLP layers; this model's are mixtures of experts"):
        LLM(str(directory), enable_lora=True, kv_cache_memory_gib=0.02, max_model_len=64)


def test_transformers5_fused_expert_layout_loads(moe_models, tmp_path):
    """A checkpoint holding the experts stacked (transformers 5's in-memory names) loads the same module."""
    _, hf, ours, directory = moe_models
    state = {name: t.contiguous() for name, t in hf.state_dict().items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    fused = model.load(tmp_path)
    for (name, a), (_, b) in zip(ours.module.state_dict().items(), fused.module.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_missing_expert_is_a_one_line_error(moe_models, tmp_path):
    from safetensors import safe_open

    _, _, _, directory = moe_models
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        names = f.keys()
        kept = [name for name in names if not (name.startswith("model.layers.0.") and ".experts.5." in name)]
        state = {name: f.get_tensor(name) for name in kept}
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"missing tensor 'layers\.0\..*experts\.5\..*' \(8 experts\)"):
        model.load(tmp_path)


def test_w8a8_quantization_is_refused(moe_models):
    with pytest.raises(ModelLoadError, match=r"--quantization int8, w4a8 \(a GGUF file\) or none"):
        model.load(moe_models[3], quantization="w8a8")


def test_int8_quantizes_the_experts_and_keeps_the_router_float(moe_models):
    """`--quantization int8` runs as the float model would on the int8 weights, dequantized: every linear
    but the router, and each expert, per output channel."""
    from quantized_reference import round_as_int8

    from model.moe import Int8SparseMoeBlock
    from model.quantization import Int8Linear

    _, _, ours, directory = moe_models
    low = model.load(directory, quantization="int8")
    sparse = [layer.mlp for layer in low.module.layers if isinstance(layer.mlp, Int8SparseMoeBlock)]
    assert len(sparse) == sum(ours.config.is_sparse_layer(i) for i in range(ours.config.num_layers))
    assert all(type(block.gate) is torch.nn.Linear and block.w13.dtype == torch.int8 for block in sparse)
    assert isinstance(low.module.layers[0].self_attn.qkv_proj, Int8Linear)
    ref = model.load(directory).module
    round_as_int8(ref, (SparseMoeBlock,))
    ids = prompt(57, seed=1)
    assert relative_error(Generator(low.module, 64).step(ids), Generator(ref, 64).step(ids)) < 1e-4


def test_tensor_parallel_refuses_a_size_that_does_not_divide_the_experts(moe_models):
    """Expert parallelism (tests/parallel/test_expert_parallel.py) holds E / size whole experts a rank."""
    from parallel.tensor_parallel_model import start

    with pytest.raises(ValueError, match="does not divide the model's 8 experts"):
        start(moe_models[2], 3, attention="sequences")  # refused before any worker starts


@pytest.mark.parametrize("family,arch,qtype,fused", [
    ("qwen3_moe", "qwen3moe", "F32", False), ("mixtral", "llama", "F32", False), ("mixtral", "llama", "Q8_0", False),
    ("qwen3_moe", "qwen3moe", "Q4_0", False), ("qwen3_moe", "qwen3moe", "Q4_0", True)])
def test_gguf_matches_transformers(tmp_path, family, arch, qtype, fused):
    """A GGUF with llama.cpp's expert tensors (ffn_gate_inp, ffn_{gate,up,down}_exps [E, out, in], or gate and
    up as one ffn_gate_up_exps [E, 2 out, in] as newer converters write transformers 5's stacks; every weight in
    `qtype`) loads to transformers' logits on the weights the file holds, in float and (fused) in W4A8;
    Qwen3-MoE's dense middle layer comes back as a dense layer (no router tensor)."""
    import transformers

    from tiny_models import hf_config, write_gguf

    cfg = hf_config(family)
    cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads  # the head size llama.cpp implies
    cfg.norm_topk_prob = True  # as llama.cpp runs qwen3moe (and Mixtral) files
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    hf.load_state_dict(write_gguf(hf, tmp_path / "m.gguf", qtype, arch, fused_experts=fused))
    ours = model.load(tmp_path / "m.gguf")
    assert ours.config.architecture == family
    assert is_moe_checkpoint(tmp_path / "m.gguf")  # `auto`: W4A8 for a quantized file, else float32
    assert ours.config.dense_layers == ((1,) if family == "qwen3_moe" else ())
    ids = prompt(45, seed=3)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert relative_error(Generator(ours.module, 64).step(ids), ref) < 1e-4
    if fused:  # the W4A8 experts take the fused stack's rows as gate then up
        w4a8 = model.load(tmp_path / "m.gguf", quantization="w4a8")
        assert relative_error(Generator(w4a8.module, 64).step(ids), ref) < 0.05
