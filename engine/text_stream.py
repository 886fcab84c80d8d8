"""A request's generated text: incremental detokenization and stop strings.

Text is released only when it can no longer change: the detokenizer holds back partial UTF-8
characters, and this class holds back any tail that could still grow into a stop string, so a stream
never shows part of a stop string, and never half a character.
"""

from __future__ import annotations

from model.detokenizer import IncrementalDetokenizer
from model.tokenizer import Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer | None, stop: tuple[str, ...], skip_special_tokens: bool = True) -> None:
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none")
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens) if tokenizer else None
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.pending = ""  # decoded but not yet released
        self.text = ""  # everything released so far
        self.stopped = False  # a stop string was found; the text ends before it

    def push(self, token_id: int) -> str:
        """Add a token; return the newly released text."""
        if self.detokenizer is None or self.stopped:
            return ""
        return self._release(self.detokenizer.push(token_id), final=False)

    def finish(self) -> str:
        """The request ended: release whatever is held."""
        if self.detokenizer is None or self.stopped:
            return ""
        return self._release(self.detokenizer.flush(), final=True)

    def _release(self, piece: str, final: bool) -> str:
        self.pending += piece
        cut = self._find_stop()
        if cut is not None:
            out, self.pending, self.stopped = self.pending[:cut], "", True
        elif final or not self.stop:
            out, self.pending = self.pending, ""
        else:
            keep = min(self.hold, len(self.pending))
            split = len(self.pending) - keep
            out, self.pending = self.pending[:split], self.pending[split:]
        self.text += out
        return out

    def _find_stop(self) -> int | None:
        """Earliest start of a stop string in the pending text (it may begin in the held tail)."""
        found = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        return min(found) if found else None
