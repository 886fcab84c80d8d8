"""Text <-> token ids for a model, built from a Hugging Face directory or from GGUF metadata.

Both sources end up as one ``tokenizers.Tokenizer`` plus the few facts serving needs around it:
which ids start and stop a sequence, whether BOS is prepended, and the chat template.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

from model.chat_template import BUILTIN_TEMPLATES, compile_chat_template, render_chat_template
from model.errors import ModelLoadError, one_line
from model.gguf_vocab import (
    BOS_BY_DEFAULT,
    CONTROL,
    END_OF_TURN,
    NORMAL,
    add_gguf_added_tokens,
    byte_level_bpe,
    sentencepiece_bpe,
    spm_merges_bpe,
)

__all__ = ["Tokenizer"]

log = logging.getLogger(__name__)

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


# Fill-in-the-middle tokens (prefix, suffix, middle) by their spelling in the families that have them:
# Qwen2.5/Qwen3-Coder, StarCoder (and SantaCoder, StarCoder2), DeepSeek-Coder, CodeLlama.
FIM_SPELLINGS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
                 ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
                 ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
                 ("▁<PRE>", "▁<SUF>", "▁<MID>"))


FIM_STOP_SPELLINGS = ("▁<EOT>", "<EOT>", "<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<file_sep>",
                      "<｜end▁of▁sentence｜>")


def _fim_by_spelling(backend: tokenizers.Tokenizer) -> tuple[int, int, int] | None:
    for spelling in FIM_SPELLINGS:
        ids = [backend.token_to_id(token) for token in spelling]
        if None not in ids:
            return tuple(ids)
    return None


def _gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for themselves, the other 68
    (controls, space, DEL, NBSP, soft hyphen) take the characters from U+0100 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}


_BYTE_OF_CHAR = _gpt2_byte_alphabet()

# A conversation every chat template accepts, to check `encode_chat` against `encode` once per tokenizer.
_PROBE_CHAT = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
               {"role": "user", "content": "Why?"})


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus BOS/EOS/stop-id facts and the model's chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
        extra_stop_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        fim_token_ids: Sequence[int] | None = None,
    ) -> None:
        """Ids default to the vocabulary ids of ``bos_token``/``eos_token``; pass them when known.
        ``fim_token_ids``: (prefix, suffix, middle) as a GGUF file names them; default: found by spelling."""
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = bos_token_id if bos_token_id is not None else _token_id(backend, bos_token)
        self.eos_token_id = eos_token_id if eos_token_id is not None else _token_id(backend, eos_token)
        self.add_bos_token = bool(add_bos_token and self.bos_token_id is not None)
        self.add_eos_token = bool(add_eos_token and self.eos_token_id is not None)
        self.chat_template = chat_template
        stops = {int(i) for i in extra_stop_ids}
        if self.eos_token_id is not None:
            stops.add(self.eos_token_id)
        harmony = [_token_id(backend, t) for t in HARMONY_STOPS]
        if None not in harmony:  # GPT-OSS: <|end|> closes a message (its analysis) but not the reply
            stops = (stops | set(harmony)) - {_token_id(backend, "<|end|>")}
        self.stop_token_ids: frozenset[int] = frozenset(stops)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.fim_token_ids: tuple[int, int, int] | None = (
            tuple(int(i) for i in fim_token_ids) if fim_token_ids is not None else _fim_by_spelling(backend))

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        """Load ``tokenizer.json`` and its companion config files from a Hugging Face model directory."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"{tokenizer_file}: missing; a tokenizer directory needs tokenizer.json")
        try:
            backend = _with_visible_markers(tokenizers.Tokenizer.from_file(str(tokenizer_file)))
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise ModelLoadError(f"{tokenizer_file}: cannot parse: {one_line(exc)}") from exc
        config = _read_json(path / "tokenizer_config.json")
        special_map = _read_json(path / "special_tokens_map.json")
        bos = _token_content(config.get("bos_token")) or _token_content(special_map.get("bos_token"))
        eos = _token_content(config.get("eos_token")) or _token_content(special_map.get("eos_token"))
        probe_bos, probe_eos = _post_processor_adds(backend, bos, eos)
        eos_ids = _read_json(path / "generation_config.json").get("eos_token_id")
        eos_ids = [i for i in (eos_ids if isinstance(eos_ids, list) else [eos_ids]) if isinstance(i, int)]
        if eos is None and eos_ids:  # some repos name their EOS only in generation_config.json
            eos = backend.id_to_token(eos_ids[0])
        return cls(
            backend,
            bos_token=bos,
            eos_token=eos,
            # An explicit flag wins; otherwise trust what tokenizer.json's post-processor would add.
            add_bos_token=_flag(config.get("add_bos_token"), probe_bos),
            add_eos_token=_flag(config.get("add_eos_token"), probe_eos),
            chat_template=_hf_chat_template(path, config),
            extra_stop_ids=eos_ids,
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], source: str) -> Tokenizer:
        """Build the tokenizer a GGUF file describes (``tokenizer.ggml.*`` keys, as llama.cpp reads them)."""
        kind = metadata.get("tokenizer.ggml.model")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelLoadError(f"{source}: GGUF metadata has no tokenizer.ggml.tokens")
        tokens = [str(t) for t in tokens]
        types = [int(t) for t in metadata.get("tokenizer.ggml.token_type") or ()]
        types = (types + [NORMAL] * len(tokens))[: len(tokens)]
        if kind == "gpt2":
            backend = byte_level_bpe(metadata, tokens, source)
            add_bos_default = metadata.get("tokenizer.ggml.pre") in BOS_BY_DEFAULT  # as llama.cpp defaults it
        elif kind == "llama":
            backend = sentencepiece_bpe(metadata, tokens, types)
            add_bos_default = True  # llama.cpp's default for SentencePiece vocabularies
        elif kind == "gemma4":
            backend = spm_merges_bpe(metadata, tokens, source)
            add_bos_default = True
        else:
            raise ModelLoadError(f"{source}: unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama, "
                                 "gemma4)")
        add_gguf_added_tokens(backend, tokens, types)
        backend = _with_visible_markers(backend)  # Mistral's control tokens [TOOL_CALLS], [ARGS] in a GGUF

        def id_at(key: str) -> int | None:
            index = metadata.get(f"tokenizer.ggml.{key}")
            return int(index) if index is not None and 0 <= int(index) < len(tokens) else None

        bos_id, eos_id = id_at("bos_token_id"), id_at("eos_token_id")
        fim = [id_at(f"fim_{part}_token_id") for part in ("pre", "suf", "mid")]
        stops = [i for i in (id_at("eot_token_id"), id_at("eom_token_id")) if i is not None]
        stops += [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL and t in END_OF_TURN]
        template = metadata.get("tokenizer.chat_template") or BUILTIN_TEMPLATES.get(
            str(metadata.get("general.architecture")))
        return cls(
            backend,
            bos_token=tokens[bos_id] if bos_id is not None else None,
            eos_token=tokens[eos_id] if eos_id is not None else None,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            # llama.cpp adds BOS to a Gemma 4 prompt whatever the file says
            add_bos_token=kind == "gemma4" or bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)),
            add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=str(template) if template else None,
            extra_stop_ids=stops,
            fim_token_ids=fim if None not in fim else None,
        )

    # Files `save` writes: the tokenizers model, and the facts kept beside it.
    SAVED_BACKEND, SAVED_FACTS = "tokenizer.json", "tokenizer_facts.json"

    def save(self, directory: Path) -> list[str]:
        """Write this tokenizer so `from_saved` rebuilds it exactly, whatever it was built from
        (a GGUF vocabulary included); returns the file names written."""
        directory = Path(directory)
        self.backend.save(str(directory / self.SAVED_BACKEND))
        facts = {
            "bos_token": self.bos_token, "eos_token": self.eos_token,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "add_bos_token": self.add_bos_token, "add_eos_token": self.add_eos_token,
            "chat_template": self.chat_template, "stop_token_ids": sorted(self.stop_token_ids),
            "fim_token_ids": self.fim_token_ids,
        }
        (directory / self.SAVED_FACTS).write_text(json.dumps(facts, indent=1), encoding="utf-8")
        return [self.SAVED_BACKEND, self.SAVED_FACTS]

    @classmethod
    def from_saved(cls, directory: Path) -> Tokenizer:
        directory = Path(directory)
        backend_file = directory / cls.SAVED_BACKEND
        try:
            backend = tokenizers.Tokenizer.from_file(str(backend_file))
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise ModelLoadError(f"{backend_file}: cannot parse: {one_line(exc)}") from exc
        facts = _read_json(directory / cls.SAVED_FACTS)
        stops = facts.pop("stop_token_ids", [])
        return cls(backend, extra_stop_ids=stops, **facts)

    # -- use ---------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text``; special-token strings in it become their ids.

        With ``add_special_tokens`` BOS (and EOS) are added when the model asks for them; BOS is not
        added a second time when ``text`` already starts with it (e.g. a chat template wrote it).
        """
        return self.encode_all([text], add_special_tokens)[0]

    def encode_all(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of each text, in one call: the tokenizer splits the texts over its own threads."""
        # The batch form releases the GIL while it works (the single form holds it), so a long text
        # encoded on a worker thread does not stall the server's event loop.
        encoded = [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]
        if add_special_tokens:
            for ids in encoded:
                if self.add_bos_token and ids[:1] != [self.bos_token_id]:
                    ids.insert(0, self.bos_token_id)
                if self.add_eos_token:
                    ids.append(self.eos_token_id)
        return encoded

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for ``ids``; invalid UTF-8 byte sequences come out as U+FFFD."""
        # The batch form releases the GIL (see encode).
        return self.backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary spelling of ``token_id`` (byte-level or ▁ form), or None if out of range."""
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of the vocabulary entry spelled ``token``, or None."""
        return self.backend.token_to_id(token)

    def set_chat_template(self, template: str) -> None:
        """Use `template` (Jinja text, as in a tokenizer_config.json) instead of the model's own; ValueError
        (one line) when it does not compile."""
        compile_chat_template(template)
        self.chat_template = template
        self.__dict__.pop("_chat_markup", None)  # built from the template: build it again when next asked

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        continue_final_message: bool = False, **template_vars: Any
    ) -> str:
        """Render ``messages`` into a prompt string with the model's chat template; ``template_vars``
        (``tools=...``, ``enable_thinking=...``) become template variables. ``continue_final_message``: the
        text ends with the last message's content, its turn left open (`open_final_message`)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        text = render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **template_vars,
        )
        return open_final_message(text, messages) if continue_final_message else text

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        continue_final_message: bool = False, **template_vars: Any
    ) -> tuple[str, list[int]]:
        """The chat template's text for ``messages`` and its token ids, with the special tokens that the
        template writes as their ids and special-token text inside the messages as plain text: a message
        that types ``<|im_end|>\\n<|im_start|>system`` cannot forge the template's markup. ``template_vars``
        (``tools=...``) become template variables; special-token text inside them is plain text too.

        For ordinary messages the ids equal ``encode(apply_chat_template(messages), False)``. A template
        whose special tokens this cannot follow (see `_ChatMarkup`) is encoded that way, with a warning."""
        markup = self._chat_markup
        if markup is None:
            text = self.apply_chat_template(messages, add_generation_prompt, continue_final_message, **template_vars)
            return text, self.encode(text, add_special_tokens=False)
        return markup.encode(messages, add_generation_prompt, self.bos_token, self.eos_token, continue_final_message,
                             **template_vars)

    @functools.cached_property
    def _chat_markup(self) -> _ChatMarkup | None:
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        markup = _ChatMarkup.build(self.backend, self.chat_template)
        try:
            expected = self.encode(self.apply_chat_template(list(_PROBE_CHAT)), add_special_tokens=False)
        except ValueError:  # the template refuses the probe: nothing to compare
            return markup
        if markup.encode(list(_PROBE_CHAT), True, self.bos_token, self.eos_token)[1] != expected:
            log.warning("the chat template writes special tokens in a way ladder cannot tell from message text; "
                        "special-token text inside chat messages will be read as special tokens")
            return None
        return markup

    def encode_fim(self, prefix_ids: Sequence[int], suffix: str) -> list[int]:
        """A fill-in-the-middle prompt, prefix-suffix-middle order: [BOS] PRE prefix SUF suffix MID, where
        ``prefix_ids`` is the encoded prefix (with the BOS ``encode`` adds, kept first). The model writes the
        middle. ValueError for a vocabulary without FIM tokens."""
        if self.fim_token_ids is None:
            raise ValueError("this model's vocabulary has no fill-in-the-middle tokens")
        pre, suf, mid = self.fim_token_ids
        bos = 1 if self.bos_token_id is not None and list(prefix_ids[:1]) == [self.bos_token_id] else 0
        return [*prefix_ids[:bos], pre, *prefix_ids[bos:], suf, *self.encode(suffix, add_special_tokens=False), mid]

    @functools.cached_property
    def fim_stop_ids(self) -> frozenset[int]:
        """Tokens that end a fill-in-the-middle answer beside the stop tokens (CodeLlama's <EOT>, the file
        separators and FIM padding of the coder vocabularies), where the vocabulary has them."""
        ids = (self.backend.token_to_id(token) for token in FIM_STOP_SPELLINGS)
        return frozenset(i for i in ids if i is not None)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` adds to a text, a partial UTF-8 character kept partial (``decode`` would
        write U+FFFD for it): what OpenAI's logprobs ``bytes`` and llama.cpp's token pieces carry. Byte-level
        vocabularies spell bytes in GPT-2's byte alphabet; SentencePiece ones spell a space as ▁ and a byte
        as <0xNN> (a decoder may drop the leading space of a text's first token: these bytes keep it); an
        added token is its own text. Out of range: b""."""
        token = self.backend.id_to_token(token_id)
        if token is None:
            return b""
        if token_id in self.added_ids:
            return token.encode()
        if self._byte_level:
            try:
                return bytes(_BYTE_OF_CHAR[c] for c in token)
            except KeyError:  # not in the byte alphabet: a vocabulary that spells this one as text
                return token.encode()
        if _BYTE_TOKEN.fullmatch(token):
            return bytes([int(token[3:5], 16)])
        return token.replace("\u2581", " ").encode()

    @functools.cached_property
    def added_ids(self) -> frozenset[int]:
        """Ids of the added tokens (special or not): whole text splits at them before the model's own
        tokenization."""
        return frozenset(self.backend.get_added_tokens_decoder())

    @functools.cached_property
    def _byte_level(self) -> bool:
        return isinstance(self.backend.decoder, tokenizers.decoders.ByteLevel)

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids that ``decode(..., skip_special_tokens=True)`` drops."""
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    @functools.cached_property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of ``<0xNN>`` tokens that the decoder joins into UTF-8; empty without byte fallback."""
        if not getattr(self.backend.model, "byte_fallback", False):
            return frozenset()
        return frozenset(i for t, i in self.backend.get_vocab().items() if _BYTE_TOKEN.fullmatch(t))


# Control tokens a reply's text must keep for the server to read it (Gemma 4's thinking channel, tool calls and
# string quotes, as llama.cpp's converter marks them in a GGUF: user-defined, not control; Mistral's tool calls
# and Magistral's thinking; GPT-OSS's message headers, server/harmony.py): decoding keeps them.
VISIBLE_MARKERS = frozenset({"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                             "<tool_response|>", '<|"|>', "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[THINK]",
                             "[/THINK]", "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"})
# GPT-OSS's (harmony's) ends of a reply: an answer, and a tool call. A vocabulary with both stops at them and
# not at <|end|>, which only closes a message (the analysis before the answer), as llama.cpp reads it.
HARMONY_STOPS = ("<|return|>", "<|call|>")


def _with_visible_markers(backend: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    """`backend` with VISIBLE_MARKERS among its special added tokens made ordinary ones (still matched whole)."""
    if not any(t.special and t.content in VISIBLE_MARKERS for t in backend.get_added_tokens_decoder().values()):
        return backend
    data = json.loads(backend.to_str())
    for token in data.get("added_tokens", ()):
        if token["content"] in VISIBLE_MARKERS:
            token["special"] = False
    return tokenizers.Tokenizer.from_str(json.dumps(data))


# -- chat markup -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _ChatMarkup:
    """A chat template whose special tokens are told apart from the messages' text.

    Each special token is given an alias (a private-use character, a random nonce, its id): the template's
    source spells its special tokens as their aliases (so do ``bos_token`` and ``eos_token``), and a copy
    of the backend matches the aliases as added tokens with the same flags while it matches no special
    token (``encode_special_tokens``). One encode of the rendered text then splits it exactly where the
    special tokens split it before, so ordinary messages get the same ids; the aliases' ids map back to
    the special tokens' ids. A message cannot spell an alias without the nonce, which never leaves the
    process. A template that builds a special token's text from pieces (or reads another token variable)
    escapes this; `Tokenizer._chat_markup` notices it on a probe conversation. A template that compares a
    message's text with a special token's text sees the alias instead, which only a message that types
    special-token text can tell."""

    template: str
    backend: tokenizers.Tokenizer
    alias_of: dict[str, str]  # special token text -> its alias
    text_of: dict[str, str]  # alias -> special token text
    id_of: dict[int, int]  # an alias's id in `backend` -> the special token's id
    pattern: re.Pattern[str]  # any alias

    @classmethod
    def build(cls, backend: tokenizers.Tokenizer, template: str) -> _ChatMarkup:
        specials = {t.content: (i, t) for i, t in backend.get_added_tokens_decoder().items() if t.special}
        nonce = secrets.token_hex(8)
        alias_of = {text: f"\ue000{nonce}{i}\ue001" for text, (i, _) in specials.items()}
        for text in sorted(alias_of, key=len, reverse=True):  # longest first: one may contain another
            template = template.replace(text, alias_of[text])
        plain = tokenizers.Tokenizer.from_str(backend.to_str())
        plain.encode_special_tokens = True
        plain.add_tokens([tokenizers.AddedToken(alias_of[text], single_word=t.single_word, lstrip=t.lstrip,
                                                rstrip=t.rstrip, normalized=t.normalized, special=False)
                          for text, (_, t) in specials.items()])
        id_of = {plain.token_to_id(alias_of[text]): i for text, (i, _) in specials.items()}
        return cls(template, plain, alias_of, {a: t for t, a in alias_of.items()}, id_of,
                   re.compile(f"\ue000{nonce}\\d+\ue001"))

    def _alias(self, token: str | None) -> str | None:
        return self.alias_of.get(token, token) if token is not None else None

    def encode(self, messages: list[dict[str, Any]], add_generation_prompt: bool, bos_token: str | None,
               eos_token: str | None, continue_final_message: bool = False, **template_vars: Any
               ) -> tuple[str, list[int]]:
        aliased = render_chat_template(
            self.template, messages, add_generation_prompt=add_generation_prompt,
            bos_token=self._alias(bos_token), eos_token=self._alias(eos_token), **template_vars,
        )
        if continue_final_message:  # a message cannot spell an alias, so the cut never splits one
            aliased = open_final_message(aliased, messages)
        # The batch form releases the GIL (see Tokenizer.encode).
        ids = self.backend.encode_batch([aliased], add_special_tokens=False)[0].ids
        return self.pattern.sub(lambda m: self.text_of[m.group()], aliased), [self.id_of.get(i, i) for i in ids]


def open_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """The rendered chat cut right after the last message's content, so that the model continues that
    message (a reply's prefilled start) instead of closing its turn. The content is found as the template
    wrote it, surrounding whitespace stripped (templates often strip it), at its last place in the text."""
    content = messages[-1].get("content") if messages else None
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message needs a last message with text content")
    at = text.rfind(content.strip())
    if at < 0:
        raise ValueError("continue_final_message: the chat template does not write the last message's text as "
                         "it is, so it cannot be left open")
    return text[:at + len(content.strip())]


# -- Hugging Face directory ------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON: {one_line(exc)}") from exc
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _flag(value: Any, default: bool) -> bool:
    return value if isinstance(value, bool) else default


def _hf_chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(path / "chat_template.json").get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) and template else None


def _post_processor_adds(backend: tokenizers.Tokenizer, bos: str | None, eos: str | None) -> tuple[bool, bool]:
    """Whether tokenizer.json's post-processor prepends BOS / appends EOS to a single sequence."""
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    grew = len(full) > len(plain)
    bos_id, eos_id = _token_id(backend, bos), _token_id(backend, eos)
    return grew and bos_id is not None and full[0] == bos_id, grew and eos_id is not None and full[-1] == eos_id


def _token_id(backend: tokenizers.Tokenizer, token: str | None) -> int | None:
    return backend.token_to_id(token) if token is not None else None
