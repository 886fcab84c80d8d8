"""Structured outputs in the engine (engine/guide.py, engine/guide_masks.py, the sampler's masks): every
guide kind's output matches it, guided rows leave the batch's other rows bit for bit as they were, a guided
row's tokens do not depend on its batch, logit_bias, and bad guides refused quickly.

On the tiny random model with SmolLM2's real tokenizer: its text is noise, which is the hard case for a
grammar (the model never "wants" to follow it), and every token path is real."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from engine.guide import Guide, GuideCompiler, GuideError
from engine.llm import LLM
from engine.sampling_params import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "mood": {"enum": ["happy", "sad", "calm"]},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 100}, "maxItems": 3},
    },
    "required": ["name", "age", "mood", "scores"],
    "additionalProperties": False,
}
DATE = r"\d{4}-\d{2}-\d{2}"
PROMPTS = ["Describe a person:", "The date is", "Pick one:", "Hello"]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir), kv_cache_memory_gib=0.02, max_num_seqs=16)


def run(llm, prompts, params):
    return [r.outputs[0] for r in llm.generate(prompts, params)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_kind_of_guide_is_followed(llm, temperature):
    params = dict(temperature=temperature, seed=7, max_tokens=200)
    for out in run(llm, PROMPTS, SamplingParams(**params, guide=Guide.json_schema(SCHEMA))):
        assert out.finish_reason.value == "stop", out.text  # the grammar ended it, not max_tokens
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert list(json.loads(out.text)) == list(SCHEMA["properties"])  # the schema's key order
    for out in run(llm, PROMPTS, SamplingParams(**params, guide=Guide.regex(DATE))):
        assert re.fullmatch(DATE, out.text) and out.finish_reason.value == "stop", out.text
    choices = ["yes", "no", "maybe not"]
    for out in run(llm, PROMPTS, SamplingParams(**params, guide=Guide.choice(choices))):
        assert out.text in choices
    gbnf = 'root ::= "(" [0-9] " + " [0-9] ")"'
    for out in run(llm, PROMPTS, SamplingParams(**params, guide=Guide.grammar(gbnf))):
        assert re.fullmatch(r"\(\d \+ \d\)", out.text), out.text
    lark = 'start: "call " NAME "(" ")"\nNAME: /[a-z]{1,8}/'
    for out in run(llm, PROMPTS, SamplingParams(**params, guide=Guide.grammar(lark))):
        assert re.fullmatch(r"call [a-z]{1,8}\(\)", out.text), out.text


def test_any_json_object_stays_within_max_tokens(llm):
    # Noise rarely closes an object on its own: the request ends at max_tokens with a prefix of one.
    for out in run(llm, PROMPTS, SamplingParams(temperature=1.0, seed=3, max_tokens=24, guide=Guide.json_object())):
        assert out.text.startswith("{")
        if out.finish_reason.value == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:
            assert len(out.token_ids) == 24


def test_unguided_rows_keep_their_tokens_and_a_guided_row_its_own(llm):
    plain = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=1.0, seed=11, max_tokens=12)]
    guided = SamplingParams(temperature=1.0, seed=5, max_tokens=60, guide=Guide.json_schema(SCHEMA))
    # The same batch with the guide taken off: every step runs the same rows (no row ends before the plain
    # ones: the schema's shortest object is longer than 12 tokens, and EOS is ignored), so the model's
    # logits are the same and only the sampler's masks differ. float32 matmuls are not batch invariant
    # (a row's last bit may depend on the rows beside it), so "alone" would test the model, not the masks.
    unguided = guided.replace(guide=None, ignore_eos=True)
    without = run(llm, PROMPTS[:2] + ["Hello"] * 3, plain + [unguided] * 3)
    guided_alone = run(llm, ["Hello"], [guided])[0].token_ids
    together = run(llm, PROMPTS[:2] + ["Hello"] * 3, plain + [guided] * 3)
    assert [o.token_ids for o in together[:2]] == [o.token_ids for o in without[:2]]
    assert all(o.token_ids == guided_alone for o in together[2:])


def test_logit_bias_forces_and_bans(llm):
    forced = run(llm, ["Hello"], SamplingParams(temperature=1.0, seed=1, max_tokens=4, logit_bias={42: 100.0}))[0]
    assert forced.token_ids == [42] * 4
    greedy = run(llm, ["Hello"], SamplingParams(temperature=0, max_tokens=1))[0].token_ids[0]
    banned = run(llm, ["Hello"], SamplingParams(temperature=0, max_tokens=1, logit_bias={greedy: -100.0}))[0]
    assert banned.token_ids[0] != greedy
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(["Hello"], SamplingParams(logit_bias={10**6: 1.0}))


def test_a_grammar_that_allows_only_a_stop_wins_over_min_tokens(llm):
    out = run(llm, ["Hello"], SamplingParams(temperature=0, max_tokens=20, min_tokens=10,
                                             guide=Guide.choice(["ok"])))[0]
    assert out.text == "ok" and out.finish_reason.value == "stop"


def test_guides_compile_once(llm):
    compiler = GuideCompiler(llm.tokenizer, llm.engine.model.config.vocab_size)
    compiler.compile(Guide.json_schema(SCHEMA))
    compiler.compile(Guide.json_schema(json.loads(json.dumps(SCHEMA))))
    assert compiler.num_compiled == 1


@pytest.mark.parametrize("make, message", [
    (lambda: Guide.regex("[a-"), "regex"),
    (lambda: Guide.json_schema({"type": "strin"}), "strin"),
    (lambda: Guide.json_schema({"$ref": "#/nowhere"}), "nowhere"),
    (lambda: Guide.grammar("root ::= undefined_rule"), "undefined_rule"),
    (lambda: Guide.json_schema('{"type": '), "not valid JSON"),
    (lambda: Guide.choice([]), "choice"),
])
def test_bad_guides_are_refused_with_their_reason(llm, make, message):
    with pytest.raises(GuideError, match=message):
        llm.engine.guides.compile(make())


def test_pathological_guides_are_refused_quickly(llm):
    deep: dict = {"type": "object"}
    for _ in range(2000):
        deep = {"type": "object", "properties": {"a": deep}}
    started = time.perf_counter()
    with pytest.raises(GuideError, match="nests"):
        Guide.json_schema(deep)
    with pytest.raises(GuideError, match="characters"):
        Guide.json_schema({"enum": [f"value-{i}" for i in range(100_000)]})
    assert time.perf_counter() - started < 2
    # The largest enum under the size bound compiles in tens of milliseconds (the lexer is built lazily).
    started = time.perf_counter()
    llm.engine.guides.compile(Guide.json_schema({"enum": [f"v{i}-{i * 7919 % 10007}" for i in range(9_000)]}))
    assert time.perf_counter() - started < 2
    # The engine serves on.
    assert run(llm, ["Hello"], SamplingParams(temperature=0, max_tokens=3))[0].token_ids


def test_a_failing_mask_ends_the_guided_requests_alone(llm, monkeypatch):
    plain = SamplingParams(temperature=0, max_tokens=6)
    alone = run(llm, ["Hello"], plain)[0].token_ids

    def broken(*args):
        raise RuntimeError("injected mask fault")

    monkeypatch.setattr(llm.engine.masker, "_executor", type("Broken", (), {"unsafe_compute_mask_ptr": broken})())
    guided = SamplingParams(temperature=0, max_tokens=6, guide=Guide.regex("[a-z]+"))
    outs = run(llm, ["Hello", "Hi"], [plain, guided])
    assert outs[0].token_ids == alone
    assert outs[1].finish_reason.value == "error" and outs[1].error == "the output constraint of this request failed"


def test_text_the_vocabulary_cannot_write_is_refused_not_a_server_error(llm):
    """SmolLM2's byte-level vocabulary holds no 0xF2 (the lead byte of U+AA364, say) and no 0x04. A choice
    that needs such a byte is refused when compiled; a regex that forces one ends its request with that
    reason as soon as the text is forced (llguidance would otherwise mask as if the byte could come and then
    refuse the token its own mask allowed), and the requests beside it keep their tokens."""
    assert {0x04, 0xF2} <= llm.engine.guides.unwritable and 0x41 not in llm.engine.guides.unwritable
    with pytest.raises(GuideError, match="choice 1 cannot be written with this model's tokens: .* 0x04"):
        llm.engine.guides.compile(Guide.choice(["fine", "\u0004bad"]))
    plain = SamplingParams(temperature=0, max_tokens=6)
    alone = run(llm, ["Hello"], plain)[0].token_ids
    forced = SamplingParams(temperature=0, max_tokens=10, guide=Guide.regex("\u00bb\u00ee\U000AA364"))
    outs = run(llm, ["Hello", "Hi"], [plain, forced])
    assert outs[0].token_ids == alone
    assert outs[1].finish_reason.value == "error" and "requires byte 0xF2 next" in outs[1].error
    either = SamplingParams(temperature=1.0, max_tokens=10, guide=Guide.regex("(\u00bb\u00ee\U000AA364|abc)"))
    seen = set()
    for seed in range(16):  # the writable alternative is written; the other ends as above, never a refused token
        out = run(llm, ["Hello"], either.replace(seed=seed))[0]
        assert out.text == "abc" if out.error is None else "requires byte 0xF2 next" in out.error
        seen.add(out.error is None)
    assert seen == {True, False}


def test_added_tokens_keep_their_ids_in_the_guides_vocabulary(llm):
    """Qwen 2.5's layout: added tokens after the vocabulary, special ones (<|im_end|>) before and after ones
    that are text (<tool_call>), which the guides' tokenizer moves into the vocabulary. Every id still names
    its own token there, with its own bytes, special or not (the tokenizers library numbers anew an added
    token it does not find in the vocabulary: the special ones after a moved one were read one id off)."""
    import llguidance
    import tokenizers

    from engine.guide import _llguidance_json

    backend = tokenizers.Tokenizer.from_str(llm.tokenizer.backend.to_str())
    first = backend.get_vocab_size(with_added_tokens=True)
    added = [("<|x_end|>", True), ("<tool_call>", False), ("</tool_call>", False), ("<|x_pad|>", True)]
    for text, special in added:
        (backend.add_special_tokens if special else backend.add_tokens)([text])
    assert [backend.token_to_id(text) for text, _ in added] == list(range(first, first + len(added)))
    lltokenizer = llguidance.LLTokenizer(_llguidance_json(backend), n_vocab=first + len(added))
    for i, (text, special) in enumerate(added):
        assert lltokenizer.is_special_token(first + i) == special, text
        assert lltokenizer.decode_bytes([first + i]) == text.encode(), text
