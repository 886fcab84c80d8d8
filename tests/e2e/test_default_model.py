"""The embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1) against transformers on the same file."""

from __future__ import annotations

import pytest
import torch

from model.default import default_model_path
from model.generator import Generator
from greedy_checks import NUM_GREEDY, assert_same_greedy

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Explain what a compiler does."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
]


@pytest.fixture(scope="module")
def ours(default_model):
    return default_model


@pytest.fixture(scope="module")
def reference():
    import transformers

    path = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    return tok, hf


def test_default_model_loads_under_its_name_with_its_config(ours):
    # How fast it loads is a figure of `ladder bench` (its load_seconds), not a test.
    assert ours.name == "SmolLM2-135M-Instruct"
    assert ours.config.num_layers == 30 and ours.config.num_kv_heads == 3


@pytest.mark.parametrize("chat", CHATS, ids=range(len(CHATS)))
def test_same_template_and_greedy_tokens(ours, reference, chat):
    tok, hf = reference
    text = ours.tokenizer.apply_chat_template(chat)
    assert text == tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = ours.tokenizer.encode(text, add_special_tokens=False)
    assert ids == tok.encode(text, add_special_tokens=False)
    # An explicit mask: otherwise transformers masks every prompt token equal to the pad id (<|im_end|>).
    prompt = torch.tensor([ids])
    gen = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NUM_GREEDY, do_sample=False,
                      output_logits=True, return_dict_in_generate=True, eos_token_id=None,
                      pad_token_id=ours.tokenizer.eos_token_id)
    ref_tokens = gen.sequences[0, len(ids):].tolist()
    mine = [s.token_id for s in Generator(ours.module, len(ids) + NUM_GREEDY).generate(ids, NUM_GREEDY)]
    assert_same_greedy(mine, ref_tokens, [step[0] for step in gen.logits])
    # The answers are real text, not noise: the capital question is answered.
    if "France" in chat[-1]["content"]:
        assert "Paris" in ours.tokenizer.decode(mine)


def test_a_lora_adapter_on_the_default_model_gives_peft_tokens(reference, tmp_path):
    """An adapter made with peft on the default model (fp32 base): ladder's greedy tokens with it equal
    peft + transformers (a divergence only at a near tie)."""
    from lora_adapters import ALL_TARGETS, make_peft_adapter

    import model
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    tok, hf = reference
    path = tmp_path / "smol-lora"
    peft_model = make_peft_adapter(None, path, dict(r=8, lora_alpha=16, target_modules=ALL_TARGETS), seed=7,
                                   b_scale=0.5, base=hf)
    llm = LLM(loaded=model.load(), lora=str(path), kv_cache_memory_gib=0.1, max_model_len=512)
    changed = 0
    for chat in CHATS[:3]:
        ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(chat), add_special_tokens=False)
        prompt = torch.tensor([ids])
        gen = peft_model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16,
                                  do_sample=False, output_logits=True, return_dict_in_generate=True,
                                  eos_token_id=None, pad_token_id=tok.eos_token_id)
        ref_tokens = gen.sequences[0, len(ids):].tolist()
        mine = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
        assert_same_greedy(mine.outputs[0].token_ids, ref_tokens, [step[0] for step in gen.logits])
        base = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False,
                           eos_token_id=None, pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
        changed += base != ref_tokens
    assert changed  # the adapter changes what the model says
