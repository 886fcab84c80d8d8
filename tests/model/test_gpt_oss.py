"""GPT-OSS: attention sinks, biased experts with a clamped SwiGLU, the published checkpoints' MXFP4 experts and
llama.cpp's GGUF layout, against transformers on the same weights. Its logits, greedy tokens and mixed batches
from a float directory are tests/model/test_model_parity.py's, as for every family."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tiny_models import GPT_OSS, hf_config, make_hf_model, write_gpt_oss_gguf

import model
from kernels.swiglu import clamped_swiglu_ref
from model.config import ModelConfig
from model.errors import ModelLoadError
from model.generator import Generator
from model.gguf_blocks import TABLE_CODES
from model.moe import GptOssMoeBlock, Int8GptOssMoeBlock, W4A8GptOssMoeBlock
from model.moe_checkpoint import MXFP4_VALUES, mxfp4_dequantize
from model.quantization import resolve_quantization


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt_oss")
    return make_hf_model(GPT_OSS, directory), directory


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_the_published_config_maps_onto_the_model_config():
    """gpt-oss-20b's config.json fields (4.x spelling: rope_scaling, experts_per_token, an MXFP4 quantization)."""
    raw = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
           "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
           "head_dim": 64, "num_local_experts": 32, "experts_per_token": 4, "num_experts_per_tok": 4,
           "vocab_size": 201088, "rms_norm_eps": 1e-05, "sliding_window": 128, "rope_theta": 150000,
           "max_position_embeddings": 131072, "swiglu_limit": 7.0, "attention_bias": True,
           "tie_word_embeddings": False, "layer_types": ["sliding_attention", "full_attention"] * 12,
           "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "rope_type": "yarn",
                            "original_max_position_embeddings": 4096, "truncate": False},
           "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
               "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}
    cfg = ModelConfig.from_hf(raw)
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == ("gpt_oss", 32, 4)
    assert cfg.moe_intermediate_size == 2880
    assert (cfg.attention_sinks, cfg.output_bias, cfg.attention_bias) == (True, True, True)
    assert (cfg.swiglu_limit, cfg.swiglu_alpha, cfg.sliding_window, cfg.rope_theta) == (7.0, 1.702, 128, 150000.0)
    assert cfg.layer_window(0) == 128 and cfg.layer_window(1) is None
    assert cfg.rope_yarn.factor == 32 and not cfg.rope_yarn.truncate
    assert cfg.rope_attention_factor == pytest.approx(0.1 * np.log(32) + 1)
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_the_expert_block_is_transformers_own(gpt_oss):
    hf, directory = gpt_oss
    ours = model.load(directory).module
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(0)) * 3  # wide enough that the clamps bite
    block = ours.layers[0].mlp
    assert isinstance(block, GptOssMoeBlock)
    with torch.no_grad():
        ref, _ = hf.model.layers[0].mlp(x[None])
        gate_up = torch.nn.functional.linear(x, block.w13[0], block.w13_bias[0])
    assert relative_error(block(x), ref[0]) < 1e-6
    assert (gate_up.abs() > 7).any()  # the clamp changes something


def test_sinks_take_weight_without_a_value(gpt_oss):
    """One token attends to itself alone: its output is its value times exp(s) / (exp(s) + exp(sink)), so the sinks
    move even a one-token prompt's logits; with sinks of -1e4 (no weight) both models drop them alike."""
    hf, directory = gpt_oss
    ours = model.load(directory).module
    assert torch.equal(ours.layers[1].self_attn.sinks, hf.model.layers[1].self_attn.sinks)
    ids = prompt(30, seed=3)
    with_sinks = Generator(ours, 64).step(ids)
    assert relative_error(Generator(ours, 64).step([5]), hf_logits(hf, [5])) < 1e-5
    saved = [layer.self_attn.sinks.clone() for layer in hf.model.layers]
    with torch.no_grad():
        for theirs, mine in zip(hf.model.layers, ours.layers, strict=True):
            theirs.self_attn.sinks.fill_(-1e4)
            mine.self_attn.sinks.fill_(-1e4)
    try:
        without = Generator(ours, 64).step(ids)
        assert relative_error(without, hf_logits(hf, ids)) < 1e-4
        assert relative_error(without, with_sinks) > 1e-2
    finally:
        with torch.no_grad():
            for layer, tensor in zip(hf.model.layers, saved, strict=True):
                layer.self_attn.sinks.copy_(tensor)


def hf_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float -> the published layout: blocks [..., K / 32, 16] uint8 (byte j: values 2j low, 2j + 1 high)
    and E8M0 scales [..., K / 32], each block's scale the largest power of two that keeps it within 6."""
    blocks = weight.reshape(*weight.shape[:-1], -1, 32)
    top = blocks.abs().amax(-1).clamp_min(1e-30)
    exponent = torch.floor(torch.log2(top / 6)).clamp(-127, 127)
    values = torch.tensor(MXFP4_VALUES)
    scaled = blocks / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - values).abs().argmin(-1).to(torch.uint8)  # nearest of the 16 values
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exponent + 127).to(torch.uint8)


def test_mxfp4_directory_loads_as_transformers_dequantizes_it(gpt_oss, tmp_path):
    """The published checkpoints' experts: *_blocks and *_scales in place of gate_up_proj and down_proj."""
    hf, directory = gpt_oss
    tensors = load_file(directory / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = hf_mxfp4(tensors.pop(name).transpose(1, 2).contiguous())  # rows: outputs
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    ours = model.load(tmp_path)
    reference = transformers.AutoModelForCausalLM.from_config(hf.config).eval()
    state = {k: v for k, v in tensors.items() if not k.endswith(("_blocks", "_scales"))}
    for name in {n.rsplit("_", 1)[0] for n in tensors if n.endswith("_blocks")}:
        state[name] = mxfp4_dequantize(tensors[name + "_blocks"], tensors[name + "_scales"]).transpose(1, 2)
    reference.load_state_dict(state, strict=True)
    ids = prompt(40, seed=2)
    expected = hf_logits(reference, ids)
    assert relative_error(Generator(ours.module, 64).step(ids), expected) < 1e-4
    assert relative_error(expected, hf_logits(hf, ids)) > 1e-3  # the rounding is real
    # W4A8 reads the experts' own blocks as a GGUF's are read (table codes, exactly); the other linears,
    # float in these files, requantized to 8 bits a 32-block: against the float model on those same weights,
    # what is left is the activations' int8 rounding.
    from kernels.cpu_w4a8_linear import w4a8_linear
    from model.gguf_blocks import requantize_8bit

    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}  # as the published files say
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert resolve_quantization("auto", "float32", "cpu", str(tmp_path)) == "w4a8"  # float32 would be 84 GB (20B)
    assert resolve_quantization("auto", "float32", "cpu", str(directory)) == "none"  # float experts: no blocks
    w4a8 = model.load(tmp_path, quantization="w4a8")
    block = w4a8.module.layers[0].mlp
    assert isinstance(block, W4A8GptOssMoeBlock) and (block.w13_bits, block.w2_bits) == (TABLE_CODES, TABLE_CODES)
    for e in range(4):  # the file's expert weights, bit for bit
        columns = w4a8_linear(torch.eye(32), block.w2_codes[e], block.w2_scales[e], None, 64, block.w2_zero)
        assert torch.equal(columns.t(), ours.module.layers[0].mlp.w2[e])
    with torch.no_grad():
        for name, linear in ours.module.named_modules():
            if isinstance(linear, torch.nn.Linear) and not name.endswith("mlp.gate"):
                linear.weight.copy_(requantize_8bit(linear.weight.float()).dequantize())
    out, ref = Generator(w4a8.module, 64).step(ids), Generator(ours.module, 64).step(ids)
    rows = (out - ref).norm(dim=-1) / ref.norm(dim=-1)  # a token whose router flips a near tie stands out alone
    assert rows.median() < 3e-2 and (rows < 5e-2).float().mean() > 0.9, rows  # (the int8 rounding of 2 blocks)


def test_w4a8_refuses_a_directory_without_mxfp4_experts_in_one_line(gpt_oss):
    _, directory = gpt_oss
    with pytest.raises(ModelLoadError, match="GGUF file's own blocks, or MXFP4 experts") as error:
        model.load(directory, quantization="w4a8")
    assert "\n" not in str(error.value)


def test_a_missing_expert_tensor_is_a_one_line_error(gpt_oss, tmp_path):
    _, directory = gpt_oss
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_bias"]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="layers.1.mlp.experts.down_proj_bias") as error:
        model.load(tmp_path)
    assert "\n" not in str(error.value)


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    """A GPT-OSS whose YaRN ramp is rounded out to whole pairs (as llama.cpp always rotates), written as a GGUF with
    MXFP4 experts and Q8_0 projections; the reference holds what the file holds."""
    directory = tmp_path_factory.mktemp("gpt_oss_gguf")
    torch.manual_seed(1)
    config = hf_config(GPT_OSS)
    config.rope_parameters = {**config.rope_parameters, "truncate": True}
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(("bias", "sinks")):
                param.normal_(0, 0.5)
    path = directory / "gpt-oss.gguf"
    held = write_gpt_oss_gguf(hf, path, "Q8_0", "MXFP4")
    hf.load_state_dict(held, strict=True)
    return hf, path


def test_gguf_matches_transformers_on_what_the_file_holds(gguf_pair):
    hf, path = gguf_pair
    ours = model.load(path, quantization="none")
    assert ours.config.layer_types == ("sliding_attention", "full_attention") and ours.config.sliding_window == 16
    ids = prompt(40, seed=4)
    assert relative_error(Generator(ours.module, 64).step(ids), hf_logits(hf, ids)) < 1e-4


def test_w4a8_reads_the_mxfp4_experts_exactly(gguf_pair):
    """Under W4A8 each expert's MXFP4 codes are 8-bit codes times a power of two: the weights are the file's, the
    activations rounded per 32-block to int8."""
    from kernels.cpu_w4a8_linear import w4a8_linear

    hf, path = gguf_pair
    ours = model.load(path, quantization="w4a8")
    block = ours.module.layers[0].mlp
    assert isinstance(block, W4A8GptOssMoeBlock) and block.w13_bits == TABLE_CODES  # 4-bit indices, a table
    ids = prompt(40, seed=5)
    assert relative_error(Generator(ours.module, 64).step(ids), hf_logits(hf, ids)) < 2e-2
    float_block = model.load(path, quantization="none").module.layers[0].mlp
    # One expert's weights through the kernel, column by column (one-hot rows are exact in int8).
    columns = w4a8_linear(torch.eye(64), block.w13_codes[1], block.w13_scales[1], None, 64, block.w13_zero)
    assert torch.equal(columns.t(), float_block.w13[1])


def test_int8_runs_as_the_float_model_on_the_rounded_weights(gpt_oss):
    """`--quantization int8`: every linear but the router, and each expert, int8 per output channel."""
    from quantized_reference import round_as_int8

    _, directory = gpt_oss
    low = model.load(directory, quantization="int8")
    assert isinstance(low.module.layers[0].mlp, Int8GptOssMoeBlock)
    ref = model.load(directory).module
    round_as_int8(ref, (GptOssMoeBlock,))
    ids = prompt(40, seed=6)
    assert relative_error(Generator(low.module, 64).step(ids), Generator(ref, 64).step(ids)) < 1e-4


def test_the_engine_generates_as_the_generator_does(gpt_oss):
    from engine import LLM, SamplingParams

    _, directory = gpt_oss
    ours = model.load(directory)
    llm = LLM(str(directory), quantization="auto", kv_cache_memory_gib=0.02, max_model_len=256, max_num_seqs=4)
    assert llm.engine.config.quantization == "none"  # auto keeps a mixture of experts in float32
    prompts = [prompt(9 + 11 * i, seed=20 + i) for i in range(3)]  # past the 16-token window
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for ids, out in zip(prompts, outs, strict=True):
        expected = [s.token_id for s in Generator(ours.module, 64).generate(ids, 8)]
        assert list(out.outputs[0].token_ids) == expected
    # Speculative decoding verifies drafts as rows of one step (sinks and windows per row): the same tokens. The
    # model drafting for itself proposes on every step, past the 16-token window.
    drafted = LLM(str(directory), quantization="auto", kv_cache_memory_gib=0.02, max_model_len=256, max_num_seqs=4,
                  speculative_model=str(directory), speculative_tokens=4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    again, plain = drafted.generate(prompts, params), llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in plain]
    assert drafted.engine.stats.num_draft_tokens > 0


def test_clamped_swiglu_reference():
    gate_up = torch.tensor([[9.0, -2.0, 8.0, -9.0]])  # gates 9, -2; ups 8, -9
    out = clamped_swiglu_ref(gate_up, 1.702, 7.0)
    g = torch.tensor([7.0, -2.0])
    assert torch.allclose(out[0], (torch.tensor([7.0, -7.0]) + 1) * g * torch.sigmoid(1.702 * g))


def test_what_has_no_sinks_refuses_the_model_in_one_line(gpt_oss):
    """Tensor parallelism and compiled steps have no sink logits; the C++ decoder step says why it stays out."""
    from model.cpu_step import step_support
    from parallel.layout import TensorParallelLayout

    _, directory = gpt_oss
    loaded = model.load(directory)
    with pytest.raises(ValueError, match="sink logits") as error:
        TensorParallelLayout.for_model(loaded.config, 2)
    assert "\n" not in str(error.value)
    reason = step_support(loaded.module)
    assert reason is not None and ("sink" in reason or "not built" in reason)
