"""Streaming token ids -> text, one token at a time.

Decoding a token on its own is wrong in two ways: a byte-level token may hold only part of a
UTF-8 character, and SentencePiece decoders drop the leading space of whatever comes first.
So each step decodes a short window of recent tokens and emits only the text past what was
already emitted from that window. The window is trimmed to a few tokens of context whenever it
grows, which keeps every step O(window) instead of O(stream).

What is emitted over a whole stream (all pushes plus ``flush``) equals ``tokenizer.decode`` of
every id at once:

* Byte-level decoders turn the joined bytes into text with lossy UTF-8 decoding. Only the last
  U+FFFD of a decode can still change (an unfinished character that later bytes complete), so a
  trailing U+FFFD is always held back.
* Byte-fallback decoders (``<0xNN>`` tokens) turn a run of byte tokens into text only when the run
  ends, and a run that is not valid UTF-8 becomes one U+FFFD per byte, so nothing is emitted while
  the last token is a byte token.
* Special tokens that decoding skips contribute no text, so they never enter the window.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"


class _Decoder(Protocol):
    special_ids: frozenset[int]
    byte_fallback_ids: frozenset[int]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text pieces that are safe to print."""

    # Tokens kept as context when the window is trimmed. An unfinished UTF-8 character spans at most
    # 3 bytes, so at most 3 tokens; keeping more than that means the cut never splits one.
    CONTEXT = 6

    def __init__(self, tokenizer: _Decoder, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._skipped = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._byte_ids = tokenizer.byte_fallback_ids
        self._window: list[int] = []
        self._emitted = 0  # characters of decode(self._window) already emitted (or owned by context)
        self._in_byte_run = False

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it makes printable (often "", never a partial character)."""
        if token_id in self._skipped:
            return ""
        self._window.append(token_id)
        self._in_byte_run = token_id in self._byte_ids
        if self._in_byte_run:
            return ""
        text = self._decode(self._window)
        stable = _stable_length(text)
        piece = text[self._emitted : stable]
        self._emitted = max(self._emitted, stable)
        if len(self._window) > 2 * self.CONTEXT:
            self._trim()
        return piece

    def flush(self) -> str:
        """Return all text still held back (e.g. an unfinished character) and reset for a new stream."""
        text = self._decode(self._window)[self._emitted :]
        self._window.clear()
        self._emitted = 0
        self._in_byte_run = False
        return text

    def _trim(self) -> None:
        # Keep the last CONTEXT tokens as the new window; their text counts as already emitted, minus a
        # trailing U+FFFD that may still turn into a character. The kept tokens are all real (skipped
        # ones never enter), so a decoder that strips the first leading space strips it inside this
        # context rather than from new text.
        self._window = self._window[-self.CONTEXT :]
        self._emitted = _stable_length(self._decode(self._window))

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)


def _stable_length(text: str) -> int:
    """Length of the prefix of ``text`` that more tokens cannot change."""
    return len(text) - 1 if text.endswith(_REPLACEMENT) else len(text)
