"""Qwen3.5: linear-attention layers (a gated delta rule over a state per sequence) between gated attention ones,
against transformers on the same weights; the state slots a step names; what refuses the model. Qwen3.5-MoE (its
experts beside a shared one) and Qwen3-Next (the same layers, its checkpoints' projections fused per key head)
through the same tests."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from greedy_checks import NUM_GREEDY, assert_same_greedy
from tiny_models import QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT, hf_config, make_hf_model

import model
from doctor.cost import ModelCost
from model.attention_metadata import AttentionMetadata
from model.config import ModelConfig
from model.generator import Generator


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=[QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT])
def qwen3_5(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param, directory)
    return hf, directory, model.load(directory)


def test_the_published_config_maps_onto_the_model_config():
    """Qwen3.5-0.8B's config.json shape: the text model's fields under text_config beside a vision tower's,
    every fourth layer attention, M-RoPE over a quarter of each head."""
    raw = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": True,
           "text_config": {"model_type": "qwen3_5_text", "hidden_size": 1024, "intermediate_size": 3584,
                           "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2,
                           "head_dim": 256, "vocab_size": 248320, "rms_norm_eps": 1e-6, "full_attention_interval": 4,
                           "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
                           "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "hidden_act": "silu",
                           "max_position_embeddings": 262144, "eos_token_id": 248044,
                           "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                                               "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                                               "mrope_section": [11, 11, 10]}},
           "vision_config": {"depth": 12, "hidden_size": 768}}
    cfg = ModelConfig.from_hf(raw)
    assert cfg.architecture == "qwen3_5" and cfg.tie_word_embeddings
    assert cfg.linear_layers == tuple(i for i in range(24) if (i + 1) % 4)
    assert (cfg.rotary_dims, cfg.qk_norm, cfg.attention_output_gate, cfg.rope_theta) == (64, True, True, 1e7)
    linear = (cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_conv_kernel)
    assert linear == (16, 16, 128, 4)
    assert cfg.linear_state_size == 3 * 6144 + 16 * 128 * 128
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert not cfg.layers_alike
    with pytest.raises(ValueError, match="differ in shape or kind"):
        cfg.require_alike_layers("tensor parallelism")


def test_the_published_moe_config_maps_onto_the_model_config():
    """Qwen3.5-35B-A3B's text config: every layer sparse (256 experts, 8 a token, renormalised) beside a shared
    expert; no dense MLP width (the experts' stands in)."""
    raw = {"model_type": "qwen3_5_moe", "text_config": {
        "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "vocab_size": 248320, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128, "num_experts": 256,
        "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25}}}
    cfg = ModelConfig.from_hf(raw)
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == ("qwen3_5_moe", 256, 8,
                                                                                               True)
    assert (cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.dense_layers) == (512, 512, ())
    assert len(cfg.linear_layers) == 30 and cfg.linear_value_heads == 32
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_the_published_qwen3_next_config_maps_onto_the_model_config():
    """Qwen3-Next-80B-A3B's config.json: 512 experts, 10 a token, beside a shared expert, every layer sparse unless
    mlp_only_layers or decoder_sparse_step say otherwise; partial_rotary_factor at the top level."""
    raw = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
           "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
           "head_dim": 256, "vocab_size": 151936, "full_attention_interval": 4, "linear_num_key_heads": 16,
           "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
           "linear_conv_kernel_dim": 4, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
           "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "mlp_only_layers": [],
           "norm_topk_prob": True, "partial_rotary_factor": 0.25, "rope_theta": 10000000,
           "max_position_embeddings": 262144, "rms_norm_eps": 1e-06, "tie_word_embeddings": False}
    cfg = ModelConfig.from_hf(raw)
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == ("qwen3_next", 512,
                                                                                               10, True)
    assert (cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.dense_layers) == (512, 512, ())
    assert len(cfg.linear_layers) == 36 and (cfg.rotary_dims, cfg.attention_output_gate) == (64, True)
    assert ModelConfig.from_hf({**raw, "mlp_only_layers": [0], "decoder_sparse_step": 2}).dense_layers == tuple(
        i for i in range(48) if i == 0 or i % 2 == 0)
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_logits_match_transformers(qwen3_5):
    """150 tokens: the prompt's chunks of the rule (64) and a short last one."""
    hf, _, ours = qwen3_5
    ids = prompt(150, seed=1)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert relative_error(Generator(ours.module, 160).step(ids), ref) < 1e-4


def test_greedy_matches_transformers(qwen3_5):
    """Decode steps advance the states one token at a time, as transformers' cache does."""
    hf, _, ours = qwen3_5
    for seed in range(3):
        ids = prompt(11 + 7 * seed, seed=seed)
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=NUM_GREEDY, min_new_tokens=NUM_GREEDY,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)
        ours_tokens = [s.token_id for s in Generator(ours.module, 128).generate(ids, NUM_GREEDY)]
        assert_same_greedy(ours_tokens, gen.sequences[0, len(ids):].tolist(), [step[0] for step in gen.logits])


def step_logits(module, caches, shapes, seqs, tables, slots):
    """One step of every (cached, new) shape's new tokens, sequence s in state slot slots[s]."""
    meta = AttentionMetadata.build([n for _, n in shapes], [c + n for c, n in shapes], tables, module.block_size)
    meta = AttentionMetadata(**{**meta.__dict__, "state_slots": torch.tensor(slots)})
    ids = torch.tensor([t for (c, _), seq in zip(shapes, seqs) for t in seq[c:c + _]])
    positions = torch.cat([torch.arange(c, c + n) for c, n in shapes])
    with torch.inference_mode():
        return module.compute_logits(module(ids, positions, caches, meta))


def test_a_mixed_flat_batch_equals_each_sequence_alone(qwen3_5):
    """A fresh prompt, decodes, a prompt's second chunk and a one-token prompt in one step: each sequence's logits
    and states those it gets alone."""
    _, _, ours = qwen3_5
    module = ours.module
    shapes = [(0, 37), (20, 1), (16, 9), (0, 1), (33, 1)]
    seqs = [prompt(c + n, seed=10 + i) for i, (c, n) in enumerate(shapes)]
    slots = [4, 0, 2, 1, 3]  # not in the sequences' order
    caches = module.allocate_kv_caches(len(seqs) * 4, num_state_slots=5)
    tables = [list(range(i * 4, (i + 1) * 4))[::-1] for i in range(len(seqs))]
    for (cached, _), seq, table, slot in zip(shapes, seqs, tables, slots):
        if cached:
            step_logits(module, caches, [(0, cached)], [seq], [table], [slot])
    before = [c.clone() for c in caches]
    alone = [step_logits(module, caches, [shape], [seq], [table], [slot])
             for shape, seq, table, slot in zip(shapes, seqs, tables, slots)]
    after_alone = [c.clone() for c in caches]
    for cache, saved in zip(caches, before):
        cache.copy_(saved)
    batched = step_logits(module, caches, shapes, seqs, tables, slots)
    assert torch.allclose(batched, torch.cat(alone), rtol=1e-4, atol=1e-5)
    for i in module.config.linear_layers:
        assert torch.allclose(caches[i], after_alone[i], rtol=1e-4, atol=1e-5)


def test_a_prompt_in_chunks_equals_the_prompt_at_once(qwen3_5):
    """The scheduler cuts long prompts into chunks: each chunk carries the state (and the convolution's last
    inputs) into the next."""
    _, _, ours = qwen3_5
    ids = prompt(130, seed=4)
    whole = Generator(ours.module, 160).step(ids)
    gen = Generator(ours.module, 160)
    for start, end in ((0, 3), (3, 70), (70, 71), (71, 130)):
        out = gen.step(ids[start:end])
    assert relative_error(out, whole[71:]) < 1e-5


def test_the_multimodal_directory_reads_its_text_model(tmp_path):
    """Qwen3_5ForConditionalGeneration's checkpoint (the text model under model.language_model, a vision tower
    beside it, not read): transformers' logits for a text prompt."""
    torch.manual_seed(0)
    vision = transformers.Qwen3_5VisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                              out_hidden_size=64, patch_size=8, num_position_embeddings=16)
    both = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(
        text_config=hf_config(QWEN3_5).to_dict(), vision_config=vision.to_dict(), tie_word_embeddings=False)).eval()
    both.save_pretrained(tmp_path)
    ours = model.load(tmp_path)
    assert ours.config.architecture == "qwen3_5" and ours.module.vision is None
    ids = prompt(57, seed=2)
    with torch.no_grad():
        ref = both(input_ids=torch.tensor([ids])).logits[0]
    assert relative_error(Generator(ours.module, 64).step(ids), ref) < 1e-4


def test_int8_covers_the_linear_attention_and_the_experts(qwen3_5):
    """`--quantization int8`: every projection of the linear-attention layers, the experts and the shared expert
    int8 per output channel (routers and the shared expert's gate float): the float model on the rounded weights.
    W8A8 smooths the linear attention's input projection as it smooths q/k/v (a dense model; experts refuse it)."""
    from quantized_reference import round_as_int8

    from model.errors import ModelLoadError
    from model.moe import SparseMoeBlock

    _, directory, ours = qwen3_5
    low = model.load(directory, quantization="int8")
    linear = low.module.layers[0].linear_attn
    assert type(linear.in_proj).__name__ == type(linear.out_proj).__name__ == "Int8Linear"
    ref = model.load(directory).module
    round_as_int8(ref, (SparseMoeBlock,))
    ids = prompt(40, seed=6)
    assert relative_error(Generator(low.module, 64).step(ids), Generator(ref, 64).step(ids)) < 1e-4
    if ours.config.num_experts:
        assert type(low.module.layers[0].shared_expert.gate_up_proj).__name__ == "Int8Linear"
        assert type(low.module.layers[0].shared_expert_gate) is torch.nn.Linear
        with pytest.raises(ModelLoadError, match="does not cover mixture-of-experts"):
            model.load(directory, quantization="w8a8")
    else:
        smooth = model.load(directory, quantization="w8a8").module
        assert type(smooth.layers[0].linear_attn.in_proj).__name__ == "W8A8Linear"
        assert relative_error(Generator(smooth, 64).step(ids), Generator(ours.module, 64).step(ids)) < 0.2


def test_the_eager_layers_run_and_the_cost_model_counts_every_weight(qwen3_5):
    hf, _, ours = qwen3_5
    Generator(ours.module, 16).step([1, 2, 3])
    # A float model runs its eager layers (the one-call step takes W4A8 and W8A8 linears: tests/model/test_cpu_step.py).
    assert ours.module.decoder_step() is None and ("Linear linear" in ours.module.cpu_step_reason
                                                   or "SparseMoeBlock" in ours.module.cpu_step_reason)
    cost = ModelCost(ours.config, "fp32", 4)
    assert cost.num_params == sum(p.numel() for p in hf.parameters())
    assert cost.kv_bytes_per_token == 2 * (2 * 2 * 32) * 4  # two attention layers' keys and values


@pytest.fixture(scope="module", params=[QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT])
def gguf_pair(request, tmp_path_factory):
    """A Qwen3.5 (value heads as wide as key heads, as llama.cpp requires) written as llama.cpp's converter writes
    it (arch qwen35, or qwen35moe: stacked experts, the shared expert's `*_shexp` tensors), Q8_0; the reference
    holds what the file holds."""
    from tiny_models import spread_qwen3_5_parameters, write_qwen35_gguf

    directory = tmp_path_factory.mktemp("qwen35_gguf")
    config = hf_config(request.param)
    config.linear_value_head_dim = 16
    torch.manual_seed(1)
    hf = spread_qwen3_5_parameters(transformers.AutoModelForCausalLM.from_config(config).eval())
    path = directory / "qwen35.gguf"
    hf.load_state_dict(write_qwen35_gguf(hf, path, "Q8_0", mtp=True), strict=True)
    return hf, path


def test_gguf_matches_transformers_on_what_the_file_holds(gguf_pair):
    """llama.cpp's layout: value heads tiled (each reads key head j % Hk), ssm_a = -exp(A_log), norms stored as
    1 + w, the convolution [C, K]; the multi-token-prediction layer after the others (as the published files have
    one) not read."""
    hf, path = gguf_pair
    ours = model.load(path, quantization="none")
    cfg = ours.config
    next_ = cfg.architecture == "qwen3_next"  # (value heads in transformers' order; a dense MLP in layer 2)
    assert (cfg.num_layers, cfg.linear_layers, cfg.linear_heads_tiled, cfg.rotary_dims) == (4, (0, 2), not next_, 8)
    assert (cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_value_dim) == (2, 4, 16)
    assert (cfg.architecture, cfg.num_experts, cfg.shared_expert_intermediate_size, cfg.dense_layers) in (
        ("qwen3_5", 0, 0, ()), ("qwen3_5_moe", 4, 64, ()), ("qwen3_next", 4, 64, (2,)))
    ids = prompt(90, seed=4)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert relative_error(Generator(ours.module, 128).step(ids), ref) < 1e-4


def test_w4a8_computes_on_the_files_blocks(gguf_pair):
    """Under W4A8 the fused projections hold the file's weights exactly: the linear attention's four inputs in one
    in_proj, and attention's queries (rows in rotary order), keys, values and gates in one qkv_proj."""
    hf, path = gguf_pair
    low, plain = model.load(path, quantization="w4a8").module, model.load(path, quantization="none").module
    names = [(0, "linear_attn.in_proj"), (1, "self_attn.qkv_proj"), (0, "linear_attn.out_proj")]
    if low.config.num_experts:
        names.append((1, "shared_expert.gate_up_proj"))
    for i, name in names:
        w4a8, dense = low.layers[i].get_submodule(name), plain.layers[i].get_submodule(name)
        eye = torch.eye(dense.in_features)
        assert torch.equal(w4a8(eye).t(), dense.weight), name  # one-hot rows are exact in int8
    ids = prompt(40, seed=5)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    # The rest is the activations' rounding to int8 per 32-block, through four tiny random layers (qwen3's two
    # layers: 2%; here 5%, and 13% where the rounding moves a token to other experts).
    assert relative_error(Generator(low, 64).step(ids), ref) < (0.2 if low.config.num_experts else 0.1)
