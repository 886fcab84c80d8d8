"""Structured outputs: what a request's text must match, compiled once, and a matcher per sample.

A `Guide` is plain data (its kind and its text), so it is the key of the compile cache and travels in
`SamplingParams`. `GuideCompiler` turns it into an llguidance grammar for the model's vocabulary and keeps
the result (a server sends the same schema many times); each sample then gets its own matcher, a cheap copy
of the compiled one, which says which tokens may come next and follows the tokens chosen.

llguidance was chosen by measuring it beside xgrammar and outlines-core on this project's tokenizer
(benchmarks/grammar_engines.py, benchmarks/RESULTS.md): a schema compiles in about a millisecond, a mask
costs tens of microseconds, it takes JSON schema, regex, Lark and GBNF grammars, and it has no dependencies.
Its masks are computed lazily token by token, so even a large schema adds little to the first token.

JSON is generated compact (no whitespace between tokens): with free whitespace a small model can emit
newlines forever, and compact JSON is what the schema's consumer parses anyway.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import tokenizers
import torch

from model.tokenizer import Tokenizer

__all__ = ["Guide", "GuideError", "CompiledGuide", "GuideCompiler", "MAX_GUIDE_CHARS"]

KINDS = ("json_schema", "regex", "choice", "lark", "gbnf", "composed")
# The grammar text a request may send (a schema as JSON text): larger ones are refused before compiling.
MAX_GUIDE_CHARS = 128 * 1024
MAX_SCHEMA_DEPTH = 64  # nesting of a JSON schema's objects and lists
MAX_CHOICES = 4096
# llguidance's own bounds on a grammar's size and on the work of a mask (its defaults, with the lexer's
# start-up work lowered so a huge enum is refused in tens of milliseconds, not half a second).
LIMITS = dict(initial_lexer_fuel=200_000, max_grammar_size=200_000)
JSON_OPTIONS = {"whitespace_flexible": False}


class GuideError(ValueError):
    """The constraint cannot be compiled: the request's fault, a 400 with this message."""


@dataclass(frozen=True)
class Guide:
    """What a request's output must match. `text`: a JSON schema (as compact JSON text), a regex, a JSON
    list of choices, or a grammar (Lark, or llama.cpp's GBNF)."""

    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GuideError(f"unknown guide kind {self.kind!r}; one of {', '.join(KINDS)}")
        if len(self.text) > MAX_GUIDE_CHARS:
            raise GuideError(f"the {self.kind.replace('_', ' ')} has {len(self.text)} characters; this server "
                             f"compiles at most {MAX_GUIDE_CHARS}")

    @classmethod
    def json_schema(cls, schema: dict | bool | str, lenient: bool = False) -> Guide:
        """A JSON schema, as an object or as JSON text; `True` or `{}` allow any JSON value. `lenient`: a
        keyword llguidance does not implement is ignored (the rest still holds) instead of refused."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError) as error:
                raise GuideError(f"the JSON schema is not valid JSON: {error}") from None
        if not isinstance(schema, (dict, bool)):
            raise GuideError(f"a JSON schema is an object or a boolean, got {type(schema).__name__}")
        depth = _depth(schema)
        if depth > MAX_SCHEMA_DEPTH:
            raise GuideError(f"the JSON schema nests {depth} levels deep; this server compiles at most "
                             f"{MAX_SCHEMA_DEPTH}")
        if lenient:
            schema = {"x-guidance": {"lenient": True}, **schema} if isinstance(schema, dict) else schema
        # Key order kept: a schema's property order is the order the output writes them in.
        return cls("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))

    @classmethod
    def json_object(cls) -> Guide:
        """Any JSON object (OpenAI's `"response_format": {"type": "json_object"}`)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def regex(cls, pattern: str) -> Guide:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str]) -> Guide:
        if not choices or len(choices) > MAX_CHOICES or not all(isinstance(c, str) and c for c in choices):
            raise GuideError(f"a choice is a list of 1 to {MAX_CHOICES} non-empty strings")
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    @classmethod
    def after_analysis(cls, inner: Guide, end_id: int, header: str) -> Guide:
        """`inner` as the answer of a harmony reply (GPT-OSS): an optional analysis message first (any text up to
        <|end|>, token `end_id`, then `<|start|>assistant`), then `header` (the final channel's, or "" where
        `inner` writes its own: a forced call's message), then `inner`. llguidance composes the two grammars:
        a Lark one whose last item is `@inner`, the other named so."""
        text = inner.grammar_text()  # llguidance's grammar JSON, or Lark text
        own = json.loads(text) if text.lstrip().startswith("{") else {"grammars": [{"lark_grammar": text}]}
        own["grammars"][0]["name"] = "inner"
        head = f"{json.dumps(header, ensure_ascii=False)} " if header else ""
        lark = (f'start: analysis? {head}@inner\n'
                f'analysis: "<|channel|>analysis<|message|>" ANALYSIS <[{end_id}]> "<|start|>assistant"\n'
                'ANALYSIS: /(?s:.*)/\n')
        return cls("composed", json.dumps({"grammars": [{"lark_grammar": lark}, *own["grammars"]]},
                                          ensure_ascii=False))

    @classmethod
    def grammar(cls, text: str) -> Guide:
        """A context-free grammar: GBNF (llama.cpp's, rules written `name ::= ...`) or Lark."""
        return cls("gbnf" if "::=" in text else "lark", text)

    def grammar_text(self) -> str:
        """The llguidance grammar (JSON text) of this guide; raises GuideError for text that does not parse."""
        try:
            if self.kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(self.text, defaults=JSON_OPTIONS)
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.text)
            if self.kind == "choice":
                # One alternative per choice, each a quoted literal: the text itself, never a pattern.
                return llguidance.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(self.text)))
            if self.kind == "gbnf":
                return llguidance.grammar_from("gbnf", self.text)
            if self.kind == "composed":  # llguidance's grammar JSON already (`after_analysis`)
                return self.text
            return llguidance.LLMatcher.grammar_from_lark(self.text)
        except (ValueError, RecursionError) as error:
            raise GuideError(f"the {self.kind.replace('_', ' ')} does not parse: {_first_line(error)}") from None


class CompiledGuide:
    """A guide compiled for one vocabulary. `matcher()` gives a fresh matcher for one sample."""

    def __init__(self, guide: Guide, prototype: llguidance.LLMatcher) -> None:
        self.guide = guide
        self._prototype = prototype

    def matcher(self) -> llguidance.LLMatcher:
        return self._prototype.deep_copy()  # microseconds: the grammar and its lexer are shared


class GuideCompiler:
    """Compiles guides for a model's tokenizer, and keeps the last `cache_size` compiled. Thread-safe: the
    server compiles off its event loop (to answer a bad guide with a 400 before queueing), the engine thread
    finds the same entry when the request arrives."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 256) -> None:
        # ~0.4 s for a 49K vocabulary: built on first use, so models that never see a guide never pay it.
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._llg_tokenizer: llguidance.LLTokenizer | None = None
        self._unwritable: frozenset[int] = frozenset()  # with the tokenizer: bytes in no token
        self._marked = torch.zeros(0, dtype=torch.long)  # with the tokenizer: see `marked_tokens`
        self._limits = llguidance.LLParserLimits(**LIMITS, verbose_errors=False)
        self._cache: OrderedDict[Guide, CompiledGuide] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses, for tests and stats

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def unwritable(self) -> frozenset[int]:
        """The bytes no token of the vocabulary holds (found with llguidance's tokenizer, on first use)."""
        with self._lock:
            self._llg_tokenizer_locked()
            return self._unwritable

    @property
    def marked_tokens(self) -> torch.Tensor:
        """Ids [M] of the tokens llguidance takes for special ones (besides the stop tokens). Its masks may
        allow one where a grammar's text could begin with its spelling while its matcher refuses the token
        (see `_llguidance_json`, which avoids most), so the masker checks these before they are sampled."""
        with self._lock:
            self._llg_tokenizer_locked()
            return self._marked

    def compile(self, guide: Guide) -> CompiledGuide:
        with self._lock:
            compiled = self._cache.get(guide)
            if compiled is not None:
                self._cache.move_to_end(guide)
                return compiled
            tokenizer = self._llg_tokenizer_locked()
            unwritable = self._unwritable
        if guide.kind == "choice":  # a choice that needs such a byte can never be written: say which
            for i, choice in enumerate(json.loads(guide.text)):
                missing = sorted(set(choice.encode("utf-8", "surrogatepass")) & unwritable)
                if missing:
                    raise GuideError(f"choice {i} cannot be written with this model's tokens: no token holds its "
                                     f"byte 0x{missing[0]:02X}")
        grammar = guide.grammar_text()
        # The matcher reports a bad grammar (an unknown schema keyword, a regex that does not parse, a rule
        # never defined, a grammar over the limits) as its error state, not as an exception.
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise GuideError(f"the {guide.kind.replace('_', ' ')} cannot be used: {_first_line(matcher.get_error())}")
        compiled = CompiledGuide(guide, matcher)
        with self._lock:
            self.num_compiled += 1
            self._cache[guide] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _llg_tokenizer_locked(self) -> llguidance.LLTokenizer:
        if self._llg_tokenizer is None:
            stops = sorted(self._tokenizer.stop_token_ids)
            self._llg_tokenizer = llguidance.LLTokenizer(_llguidance_json(self._tokenizer.backend),
                                                         n_vocab=self._vocab_size, eos_token=stops or None)
            # A byte-level vocabulary may lack some bytes altogether (SmolLM2's has no 0xF1 or 0xF2, the lead
            # bytes of most 4-byte characters): llguidance then masks as if such a byte could come, and refuses
            # the token its own mask allowed. Known here, a guide that needs one is refused instead.
            held, marked = set(), []
            for token in range(self._llg_tokenizer.vocab_size):
                if self._llg_tokenizer.is_special_token(token):
                    marked.append(token)
                else:
                    held.update(self._llg_tokenizer.decode_bytes([token]))
            # 0xFF is in no UTF-8 text: llguidance's forced bytes start with it where a grammar names a token.
            self._unwritable = frozenset(range(255)) - held
            self._marked = torch.tensor(sorted(set(marked) - set(stops)), dtype=torch.long)
        return self._llg_tokenizer


def _llguidance_json(backend: tokenizers.Tokenizer) -> str:
    """The tokenizer as llguidance is given it. llguidance takes every added token spelled <...> for a special
    token, even one the tokenizer treats as text (Qwen's <think> and <tool_call>), and then disagrees with
    itself: where a grammar's text starts with that spelling its mask allows the token, or its forced
    tokens are that token, and its matcher refuses it (a failed request). Such a token, when its spelling is
    printable ASCII (the same text in a byte-level and in a SentencePiece alphabet), moves into the model's
    vocabulary here, where llguidance reads it as the text it is; a grammar can still name it, `<[id]>`."""
    def movable(text: str, special: bool) -> bool:
        return not special and text.isascii() and text.isprintable() and " " not in text

    text = backend.to_str()
    if not any(movable(t.content, t.special) for t in backend.get_added_tokens_decoder().values()):
        return text  # nothing to move: no parse (a second or more for a large vocabulary)
    data = json.loads(text)
    vocab = data.get("model", {}).get("vocab")
    if not isinstance(vocab, dict):  # a Unigram vocabulary is a list: left as it is (the masker still checks)
        return text
    kept = []
    for token in data.get("added_tokens") or ():
        if vocab.get(token["content"], token["id"]) != token["id"]:  # its spelling is another token's: as it is
            kept.append(token)
            continue
        # Every added token enters the vocabulary under its id, the special ones too (they stay added tokens,
        # so llguidance still takes them for special): the tokenizers library numbers an added token that is
        # not in the vocabulary anew, after the vocabulary's size, so moving the movable ones alone would
        # shift the ids of the added tokens after them (a tiny Gemma 4's <|turn> read as token 49159, not
        # 49152, and its <|"|> as <turn|>).
        vocab[token["content"]] = token["id"]
        if not movable(token["content"], token.get("special", False)):
            kept.append(token)
    data["added_tokens"] = kept
    return json.dumps(data, ensure_ascii=False)


def _depth(value: object, level: int = 0) -> int:
    """How deep a parsed JSON value nests (0 for a scalar), counted without recursion so a value nested
    thousands deep is measured, not a RecursionError."""
    deepest = level
    stack = [(value, level)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return deepest


def _first_line(error: object) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
