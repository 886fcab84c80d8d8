"""The decoder against Hugging Face transformers on the same weights, for every supported family."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

import model
from model.attention_metadata import AttentionMetadata
from greedy_checks import NUM_GREEDY, assert_same_greedy
from model.generator import Generator
from model.precision import parse_dtype
from tiny_models import FAMILIES, GEMMA4_MOE, GPT_OSS, MOE_FAMILIES, hf_config, make_hf_model, write_gguf


FOUR_LAYERS = ("smollm3", "gemma4", "gemma4_e")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


@pytest.fixture(scope="module", params=FAMILIES + MOE_FAMILIES + (GEMMA4_MOE, GPT_OSS))
def family_models(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param, directory)
    return request.param, hf, model.load(directory)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_config_maps_from_hf_fields(family_models):
    family, hf, ours = family_models
    cfg = ours.config
    assert cfg.num_kv_heads == 2 and cfg.num_heads == 4
    assert (cfg.rope_scaling is not None) == (family == "llama3")
    assert cfg.attention_bias == (family in ("qwen2", GPT_OSS))
    assert (cfg.attention_sinks, cfg.output_bias) == ((True, True) if family == GPT_OSS else (False, False))
    assert cfg.qk_norm == (family.startswith(("qwen3", "gemma")))
    assert cfg.tie_word_embeddings == (family.startswith(("qwen2", "gemma", "smollm3")))
    assert cfg.nope_layers == ((3,) if family == "smollm3" else ())
    if family == "gemma3":
        assert cfg.layer_types == ("sliding_attention", "full_attention")
        assert [cfg.layer_window(i) for i in range(2)] == [16, None]
        assert (cfg.rope_theta, cfg.rope_local_theta, cfg.hidden_act) == (1e6, 1e4, "gelu_tanh")
        assert cfg.attention_scale == 24**-0.5 and cfg.embedding_scale == 64**0.5
    if family.startswith("gemma4"):
        small = family == "gemma4_e"
        assert [(cfg.layer_head_dim(i), cfg.layer_kv_heads(i)) for i in range(4)] == (
            [(16, 2), (32, 2)] * 2 if small else [(16, 2), (32, 1)] * 2)
        assert (cfg.attention_scale, cfg.rope_proportion, cfg.value_norm) == (1.0, 0.25, True)
        assert [cfg.kv_source(i) for i in range(4)] == ([0, 1, 0, 1] if small else [0, 1, 2, 3])
        assert cfg.per_layer_input_size == (8 if small else 0)
        assert (cfg.experts_beside_mlp, cfg.num_experts) == ((True, 4) if family == GEMMA4_MOE else (False, 0))


def test_logits_match_transformers(family_models):
    _, hf, ours = family_models
    ids = prompt(57, seed=1)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    out = Generator(ours.module, 64).step(ids)
    assert relative_error(out, ref) < 1e-4


def test_greedy_matches_transformers(family_models):
    _, hf, ours = family_models
    for seed in range(3):
        ids = prompt(11 + 7 * seed, seed=seed)
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=NUM_GREEDY, min_new_tokens=NUM_GREEDY,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)
        ref_tokens = gen.sequences[0, len(ids):].tolist()
        ref_logits = [step[0] for step in gen.logits]
        ours_tokens = [s.token_id for s in Generator(ours.module, 128).generate(ids, NUM_GREEDY)]
        assert_same_greedy(ours_tokens, ref_tokens, ref_logits)


def test_mixed_flat_batch_equals_each_alone(family_models):
    """Sequences of different lengths, some with cached context (decode and chunked prefill), in one
    flat forward give the logits each gives alone."""
    _, _, ours = family_models
    module, bs = ours.module, ours.module.block_size
    # (cached tokens, new tokens): a fresh prefill, a decode, a prefill chunk after a cached prefix
    # crossing a block boundary, and a one-token prompt.
    shapes = [(0, 37), (20, 1), (16, 9), (0, 1), (33, 1)]
    seqs = [prompt(c + n, seed=10 + i) for i, (c, n) in enumerate(shapes)]
    blocks_per_seq = 4
    caches = module.allocate_kv_caches(len(seqs) * blocks_per_seq)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))[::-1] for i in range(len(seqs))]
    alone = []
    for (cached, new), seq, table in zip(shapes, seqs, tables):
        if cached:  # fill the cache with the context first
            meta = AttentionMetadata.build([cached], [cached], [table], bs)
            module(torch.tensor(seq[:cached]), torch.arange(cached), caches, meta)
        meta = AttentionMetadata.build([new], [cached + new], [table], bs)
        hidden = module(torch.tensor(seq[cached:]), torch.arange(cached, cached + new), caches, meta)
        alone.append(module.compute_logits(hidden))
    meta = AttentionMetadata.build([n for _, n in shapes], [c + n for c, n in shapes], tables, bs)
    ids = torch.tensor([t for (c, _), seq in zip(shapes, seqs) for t in seq[c:]])
    positions = torch.cat([torch.arange(c, c + n) for c, n in shapes])
    with torch.inference_mode():
        batched = module.compute_logits(module(ids, positions, caches, meta))
    assert torch.allclose(batched, torch.cat(alone), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("family,arch", [("llama3", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3"),
                                         ("gemma3", "gemma3"), ("gemma4", "gemma4"), ("gemma4_e", "gemma4"),
                                         (GEMMA4_MOE, "gemma4"), ("smollm3", "smollm3"), ("phi3", "phi3")])
def test_gguf_matches_transformers(tmp_path, qtype, family, arch):
    """A GGUF of each tensor type loads to the same logits as transformers with the weights the file
    holds (K-quant blocks are random; the others are quantized from a random model)."""
    if family.startswith("gemma4"):  # K-quants need rows of 256: every linear's input that wide
        cfg = hf_config(family, hidden_size=256, intermediate_size=512, head_dim=64, global_head_dim=64,
                        hidden_size_per_layer_input=256 if family == "gemma4_e" else 0,
                        **({"moe_intermediate_size": 256} if family == GEMMA4_MOE else {}))
    else:
        cfg = hf_config(family)
        cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = 256, 512, 64  # K-quants need rows of 256
    if family == "gemma3":  # llama.cpp scales Gemma 3's queries by head_dim (27B aside): no key says otherwise
        cfg.query_pre_attn_scalar = 64
    if family == "phi3":  # 3/4 of a 64-dim head rotates: 24 LongRoPE factors
        cfg.rope_parameters = {**cfg.rope_parameters, "short_factor": [1.0 + k / 24 for k in range(24)],
                               "long_factor": [2.0 + k / 12 for k in range(24)]}
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    held = write_gguf(hf, tmp_path / "m.gguf", qtype, arch)
    hf.load_state_dict(held)
    ours = model.load(tmp_path / "m.gguf")
    assert ours.config.architecture == arch
    assert (ours.config.rope_freq_factors is not None) == (family in ("llama3", "phi3"))  # Llama 3's, LongRoPE's
    ids = prompt(45, seed=3)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert relative_error(Generator(ours.module, 64).step(ids), ref) < 1e-4


@pytest.mark.parametrize("family", FAMILIES)  # a tiny MoE's routing flips under bfloat16 (Mixtral: 3.3%)
def test_bf16_logits_stay_close_to_fp32(family, tiny_hf_dir):
    directory = tiny_hf_dir(family)
    ours = model.load(directory)
    ids = prompt(30, seed=5)
    low = model.load(directory, dtype="bf16")
    assert low.module.embed_tokens.weight.dtype == torch.bfloat16
    ref = Generator(ours.module, 64).step(ids)
    # bfloat16's rounding grows with depth: four layers in some tiny models, two in the others.
    assert relative_error(Generator(low.module, 64).step(ids), ref) < (4e-2 if family in FOUR_LAYERS else 3e-2)


@pytest.mark.parametrize("family,arch", [("qwen3", "qwen3"), ("llama3", "llama"), ("smollm3", "smollm3")])
def test_yarn_rotates_as_transformers_from_a_directory_and_a_gguf(family, arch, tmp_path):
    """YaRN (factor 4 over an original context of 32, betas 16 and 2 from the config; a 100-token prompt): the
    same logits as transformers from config.json and from a GGUF of the same weights, and not those of the
    unscaled rotation (the check would pass vacuously otherwise)."""
    cfg = hf_config(family)
    plain = dict(cfg.rope_parameters)
    cfg.rope_parameters = {"rope_type": "yarn", "rope_theta": plain["rope_theta"], "factor": 4.0,
                           "original_max_position_embeddings": 32, "beta_fast": 16.0, "beta_slow": 2.0}
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    write_gguf(hf, tmp_path / "m.gguf", "F32", arch)
    ids = prompt(100, seed=7)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    for source in (tmp_path / "hf", tmp_path / "m.gguf"):
        ours = model.load(source)
        yarn = ours.config.rope_yarn
        assert (yarn.factor, yarn.original_max_position_embeddings, yarn.beta_fast, yarn.beta_slow) == (4, 32, 16, 2)
        assert ours.config.rope_attention_factor == pytest.approx(0.1 * math.log(4) + 1)
        assert relative_error(Generator(ours.module, 128).step(ids), ref) < 1e-4, source
    unscaled = model.load(tmp_path / "m.gguf")
    unscaled.module.config = unscaled.config.replace(rope_yarn=None, rope_attention_factor=None)
    unscaled.module.make_rotary(unscaled.module.device)
    assert relative_error(Generator(unscaled.module, 128).step(ids), ref) > 1e-2


def test_ministral3_from_its_directories_and_a_gguf(tmp_path):
    """Ministral 3 (Mistral's layers, YaRN without a cos/sin scale, Llama 4's attention temperature past the
    original 32 tokens): transformers' logits for a 100-token prompt (the temperature 1, 1.07 and 1.11 in its
    thirds) from the text model's directory, from the multimodal Mistral3ForConditionalGeneration's (its
    Pixtral tower not read) and from a GGUF of arch mistral3; the C++ step's hidden states the eager layers'
    bit for bit, the temperature included."""
    from tiny_models import ministral3_config

    torch.manual_seed(0)
    text = ministral3_config()
    hf = transformers.AutoModelForCausalLM.from_config(text).eval()
    hf.save_pretrained(tmp_path / "text")
    vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, head_dim=16, image_size=32, patch_size=16)
    both = transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
        text_config=text, vision_config=vision, image_token_index=5, tie_word_embeddings=False)).eval()
    both.model.language_model.load_state_dict(hf.model.state_dict())
    both.lm_head.load_state_dict(hf.lm_head.state_dict())
    both.save_pretrained(tmp_path / "multimodal")
    write_gguf(hf, tmp_path / "m.gguf", "F32", "mistral3")
    ids = prompt(100, seed=2)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    for source in (tmp_path / "text", tmp_path / "multimodal", tmp_path / "m.gguf"):
        ours = model.load(source)
        assert ours.config.architecture == "mistral" and ours.config.rope_yarn.factor == 4
        assert ours.config.attention_temperature_beta == pytest.approx(0.1)  # (a GGUF's float32)
        assert ours.config.attention_temperature_length == 32
        assert ours.config.rope_attention_factor == pytest.approx(1.0)  # mscale over mscale_all_dim
        assert relative_error(Generator(ours.module, 128).step(ids), ref) < 1e-4, source
        assert ours.module.query_temperature  # past 32 tokens: the eager layers, with the temperature
    w8a8 = model.load(tmp_path / "text", quantization="w8a8")  # a model the C++ step takes
    hidden = []
    for use_step in (True, False):
        w8a8.module.use_cpu_step = use_step
        hidden.append(Generator(w8a8.module, 128).step(ids))
    assert w8a8.module.cpu_step is not None and w8a8.module.query_temperature
    assert torch.equal(hidden[0], hidden[1]) and relative_error(hidden[0], ref) < 0.05
    within = Generator(ours.module, 32)  # up to 32 tokens the temperature is 1: not computed
    assert not ours.module.query_temperature
    assert relative_error(within.step(ids[:30]), ref[:30]) < 1e-4


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_gemmas_embedding_scale_is_rounded_to_the_dtype_as_transformers_rounds_it(family, tmp_path):
    """Width 80: sqrt(80) is 8.9375 in bfloat16, not 8.944. The first layer's input is transformers' bit for
    bit in bfloat16 (the scale applied unrounded put it 0.07% off, and the logits 0.8% and 2.3% from
    transformers' bfloat16 ones against 0.6% and 1.4% now), and as before in float32."""
    config = hf_config(family)
    getattr(config, "text_config", config).hidden_size = 80
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    ids = prompt(12, seed=3)
    for dtype in ("bf16", "fp32"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=parse_dtype(dtype)).eval()
        with torch.no_grad():
            ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[0][0]
        ours, seen = model.load(tmp_path, dtype=dtype), []
        ours.module.layers[0].register_forward_pre_hook(lambda _, args, seen=seen: seen.append(args[0]))
        Generator(ours.module, 32).step(ids)
        assert torch.equal(seen[0], ref), dtype


def test_phi3_takes_longrope_long_factors_past_its_original_context(tiny_hf_dir):
    """Within its original 128 tokens the tiny Phi-3 rotates by LongRoPE's short factors, past them by its long
    ones, as transformers does for a call of that length; a context served past 128 takes the long ones from its
    first token (ladder chooses by the context, as llama.cpp does), which transformers' shorter calls do not."""
    directory = tiny_hf_dir("phi3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    ours = model.load(directory)
    assert (ours.config.rotary_dim, ours.config.rope_original_max_position_embeddings) == (12, 128)
    for length, context in ((100, 128), (150, 256)):
        ids = prompt(length, seed=4)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        out = Generator(ours.module, context).step(ids)
        assert ours.module.long_context == (context > 128)
        assert relative_error(out, ref) < 1e-4
    short = prompt(40, seed=5)
    with torch.no_grad():
        ref = hf(torch.tensor([short])).logits[0]
    assert relative_error(Generator(ours.module, 256).step(short), ref) > 1e-2
