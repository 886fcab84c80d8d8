"""Token counting: an optional tokenizer.json, else estimates that the report marks as such."""

from __future__ import annotations

import random
from pathlib import Path

from loadtest.config import LoadTestError
from loadtest.words import WORDS

CHARS_PER_TOKEN = 4  # rule of thumb for English text under BPE vocabularies


def estimate_tokens(text: str) -> int:
    return max(1, round(len(text) / CHARS_PER_TOKEN))


def random_words(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


class TokenCounter:
    """A Hugging Face tokenizer.json, used to build exact-length prompts and to count tokens."""

    def __init__(self, path: str) -> None:
        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise LoadTestError(f"--tokenizer: no tokenizer.json at {path}")
        try:
            import tokenizers
        except ImportError:
            raise LoadTestError("--tokenizer needs the `tokenizers` package") from None
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(file))
        except Exception as error:  # noqa: BLE001 (the library raises bare Exceptions for malformed files)
            raise LoadTestError(f"--tokenizer: cannot read {file}: {error}") from None
        self.path = str(file)

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def exact_text(self, rng: random.Random, num_tokens: int, lead: str = "") -> str:
        """`lead` and random words, cut at a token boundary so that it encodes to exactly `num_tokens`."""
        text = lead + random_words(rng, num_tokens + 8)
        for _ in range(8):
            encoding = self._tokenizer.encode(text, add_special_tokens=False)
            if len(encoding.ids) == num_tokens:
                return text
            if len(encoding.ids) > num_tokens:
                text = text[: encoding.offsets[num_tokens - 1][1]]
            else:
                text = f"{text} {random_words(rng, num_tokens - len(encoding.ids) + 4)}"
        return text  # a tokenizer that merges across cuts may leave it a token or two off
