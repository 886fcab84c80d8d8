"""Embeddings (model/pooling.py, the engine's embedding requests): a tiny Qwen3 saved as sentence-transformers
saves Qwen3-Embedding (a bare `Qwen3Model`, last-token pooling, normalized) gives transformers' pooled hidden
states; mean and cls pooling too; chunked prompts, the prefix cache and generating requests in the same
steps change nothing; a LoRA adapter's embeddings are peft's; bad requests are refused."""

from __future__ import annotations

import json
import random

import pytest
import torch

from engine import LLM, SamplingParams
from model.pooling import Pooling, gguf_pooling, hf_dir_pooling

PROMPTS = [[random.Random(i).randrange(3, 320) for _ in range(n)] for i, n in enumerate((5, 17, 40, 1, 33))]


def write_sentence_transformers(directory, pooling_flag: str, normalize: bool) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                     pooling_flag: True}))


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """A bare Qwen3Model (no lm_head: the checkpoint's names have no `model.` prefix, the head is tied), as
    Qwen3-Embedding is saved, with its sentence-transformers files; and the transformers model itself."""
    import transformers
    from tiny_models import hf_config

    directory = tmp_path_factory.mktemp("qwen3-embedding")
    torch.manual_seed(0)
    config = hf_config("qwen3")
    config.tie_word_embeddings = True
    model = transformers.Qwen3Model(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    write_sentence_transformers(directory, "pooling_mode_lasttoken", normalize=True)
    return directory, model


def reference(model, prompts, kind: str, normalize: bool = True) -> torch.Tensor:
    rows = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model(torch.tensor([ids])).last_hidden_state[0]  # [T, hidden]
            pooled = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[kind]
            rows.append(torch.nn.functional.normalize(pooled, dim=0) if normalize else pooled)
    return torch.stack(rows)


def make_llm(directory, **config) -> LLM:
    return LLM(model=str(directory), dtype="float32", quantization="none", kv_cache_memory_gib=0.02,
               max_model_len=128, **config)


def test_sentence_transformers_pooling_is_read(embedder, tmp_path):
    directory, _ = embedder
    assert hf_dir_pooling(directory) == Pooling("last", normalize=True)
    write_sentence_transformers(tmp_path, "pooling_mode_mean_tokens", normalize=False)
    assert hf_dir_pooling(tmp_path) == Pooling("mean", normalize=False)
    write_sentence_transformers(tmp_path, "pooling_mode_max_tokens", normalize=True)
    assert hf_dir_pooling(tmp_path) is None  # not implemented: the default applies, with a warning
    assert hf_dir_pooling(tmp_path / "none") is None
    assert gguf_pooling({"general.architecture": "qwen3", "qwen3.pooling_type": 3}) == Pooling("last")
    assert gguf_pooling({"general.architecture": "llama", "llama.pooling_type": 1}) == Pooling("mean")
    assert gguf_pooling({"general.architecture": "llama"}) is None


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
def test_embeddings_equal_transformers_pooled_hidden_states(embedder, kind):
    directory, model = embedder
    llm = make_llm(directory, pooling="auto" if kind == "last" else kind)
    assert llm.engine.pooling == Pooling(kind, normalize=True)
    got = llm.embed(PROMPTS)
    want = reference(model, PROMPTS, kind)
    assert got.shape == (len(PROMPTS), 64)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert torch.allclose(got.norm(dim=1), torch.ones(len(PROMPTS)))
    # Matryoshka: the first 16 values, normalized again; and the raw pooled vector without normalizing.
    short = llm.embed(PROMPTS[:2], dimensions=16)
    torch.testing.assert_close(short, torch.nn.functional.normalize(reference(model, PROMPTS[:2], kind, False)[:, :16],
                                                                    dim=1), atol=2e-5, rtol=1e-4)
    raw = make_llm(directory, pooling=kind, embedding_normalize=False).embed(PROMPTS[:2])
    torch.testing.assert_close(raw, reference(model, PROMPTS[:2], kind, normalize=False), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["last", "mean"])
def test_chunks_the_prefix_cache_and_generation_beside_change_nothing(embedder, kind):
    """Prompts cut into 8-token chunks, a prompt seen before (its prefix cached: read for last, computed
    whole for mean), and a generating request sharing the steps: the same vectors, and the same text."""
    directory, _ = embedder
    alone = make_llm(directory, pooling=kind).embed(PROMPTS)
    llm = make_llm(directory, pooling=kind, max_num_batched_tokens=8)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    text_alone = llm.generate([PROMPTS[2]], greedy)[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request("gen", PROMPTS[2], greedy)
    for i, ids in enumerate(PROMPTS + PROMPTS[2:3]):
        engine.add_request(f"e{i}", ids, SamplingParams(max_tokens=1), pooling=kind)
    vectors, tokens, cached = {}, [], {}
    while engine.has_unfinished():
        for delta in engine.step():
            assert delta.error is None
            tokens.extend(delta.token_ids if delta.request_id == "gen" else [])
            if delta.embedding is not None:
                vectors[delta.request_id] = torch.nn.functional.normalize(delta.embedding, dim=0)
                cached[delta.request_id] = delta.num_cached_tokens
                assert delta.num_output_tokens == 0 and not delta.token_ids
    assert tokens == text_alone
    got = torch.stack([vectors[f"e{i}"] for i in range(len(PROMPTS))])
    torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(vectors[f"e{len(PROMPTS)}"], alone[2], atol=1e-5, rtol=1e-5)
    # The repeated 40-token prompt found its first 32 tokens cached when only the last token is pooled.
    assert cached[f"e{len(PROMPTS)}"] == (32 if kind == "last" else 0)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_an_adapters_embeddings_equal_peft(embedder, tmp_path):
    """A LoRA adapter's embeddings (a request naming it) equal peft's model's pooled hidden states; requests
    without it keep the base model's."""
    from lora_adapters import make_peft_adapter

    directory, model = embedder
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    settings = {"r": 4, "lora_alpha": 8, "target_modules": targets}
    peft_model = make_peft_adapter(directory, tmp_path / "adapter", settings, seed=3)
    with torch.no_grad():
        want = torch.stack([torch.nn.functional.normalize(
            peft_model.base_model.model.model(torch.tensor([ids])).last_hidden_state[0, -1], dim=0) for ids in PROMPTS])
    llm = make_llm(directory, lora_modules={"adapter": str(tmp_path / "adapter")}, max_lora_rank=4)
    torch.testing.assert_close(llm.embed(PROMPTS, lora="adapter"), want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(llm.embed(PROMPTS), reference(model, PROMPTS, "last"), atol=2e-5, rtol=1e-4)


def test_bad_embedding_requests_are_refused(embedder):
    directory, _ = embedder
    llm = make_llm(directory)
    engine = llm.engine
    with pytest.raises(ValueError, match="unknown pooling"):
        engine.add_request("a", [5, 6], SamplingParams(max_tokens=1), pooling="max")
    with pytest.raises(ValueError, match="samples nothing"):
        engine.add_request("b", [5, 6], SamplingParams(max_tokens=1, n=2), pooling="last")
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed([[5, 6]], dimensions=65)
    with pytest.raises(ValueError, match="pooling is auto"):
        make_llm(directory, pooling="max")
    # An input as long as the context fits (nothing is generated after it); one token more does not.
    assert llm.embed([[7] * 128]).shape == (1, 64)
    with pytest.raises(RuntimeError, match="exceeds max_model_len"):
        llm.embed([[7] * 129])
