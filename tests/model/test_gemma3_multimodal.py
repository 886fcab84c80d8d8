"""A multimodal Gemma 3 checkpoint (model_type gemma3: a SigLIP vision tower, a projector and a Gemma 3
language model, as the 4B, 12B and 27B ship) serves the same text logits as transformers'
Gemma3ForConditionalGeneration on a text-only prompt, the decoder never reading the vision tensors (the tower
reads them: tests/model/test_gemma3_vision.py); without a preprocessor_config.json its images take Gemma 3's
processor defaults."""

from __future__ import annotations

import pytest
import torch
import transformers

import model
from greedy_checks import NUM_GREEDY, assert_same_greedy
from model.config import ModelConfig
from model.generator import Generator
from model.hf_checkpoint import decoder_name


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    text = transformers.Gemma3TextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=24, max_position_embeddings=512, initializer_range=0.2)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4, image_token_index=300, boi_token_index=301,
                                       eoi_token_index=302)
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # Gemma's norms start at w = 0 (a scale of 1 + w): make the offset matter
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight") and "language_model" in name:
                param.normal_(0, 0.2)
    directory = tmp_path_factory.mktemp("gemma3-mm")
    hf.save_pretrained(directory, safe_serialization=True)
    return hf, model.load(directory)


def test_the_language_model_is_served(multimodal):
    hf, ours = multimodal
    assert ours.config.architecture == "gemma3" and ours.config.layer_types == ("sliding_attention", "full_attention")
    processor = ours.module.vision.processor
    assert (processor.tile_size, processor.tokens_per_tile, processor.mean) == (28, 4, (0.5, 0.5, 0.5))
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()  # no image tokens
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    out = Generator(ours.module, 64).step(ids)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-4
    prompt = ids[:20]
    gen = hf.generate(torch.tensor([prompt]), max_new_tokens=NUM_GREEDY, min_new_tokens=NUM_GREEDY, do_sample=False,
                      output_logits=True, return_dict_in_generate=True)
    mine = [s.token_id for s in Generator(ours.module, 64).generate(prompt, NUM_GREEDY)]
    assert_same_greedy(mine, gen.sequences[0, len(prompt):].tolist(), [step[0] for step in gen.logits])


def test_other_towers_are_not_the_decoders():
    assert decoder_name("language_model.model.layers.0.mlp.up_proj.weight") == "layers.0.mlp.up_proj.weight"
    assert decoder_name("model.language_model.embed_tokens.weight") == "embed_tokens.weight"
    assert decoder_name("language_model.lm_head.weight") == "lm_head.weight"
    assert decoder_name("model.layers.3.input_layernorm.weight") == "layers.3.input_layernorm.weight"
    assert decoder_name("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight") is None
    assert decoder_name("multi_modal_projector.mm_input_projection_weight") is None


def test_a_hub_style_config_takes_gemma3_defaults():
    """Gemma 3 4B's config.json names few text fields; the rest are Gemma3TextConfig's defaults."""
    cfg = ModelConfig.from_hf({
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106],
        "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                        "num_hidden_layers": 34, "sliding_window": 1024,
                        "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
        "vision_config": {"model_type": "siglip_vision_model"},
    })
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (8, 4, 256, 262_208)
    assert cfg.eos_token_ids == (1, 106) and cfg.tie_word_embeddings and cfg.sliding_window == 1024
    assert cfg.rope_linear_factor == 8.0 and (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    assert cfg.layer_types.count("full_attention") == 5 and cfg.layer_types[5] == "full_attention"
    assert cfg.attention_scale == 256**-0.5 and cfg.embedding_scale == 2560**0.5
