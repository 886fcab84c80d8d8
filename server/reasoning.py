"""A reasoning model's thinking, split from its answer: `reasoning_content` beside `content`.

Qwen3, QwQ and DeepSeek-R1's distillations write their reasoning first, inside one <think> ... </think>
block, then the answer; Gemma 4 inside <|channel>thought ... <channel|> (the channel's name, "thought", is not
reasoning); Magistral and Ministral 3's reasoning models inside [THINK] ... [/THINK]. The server answers chat requests with the block's text in `message.reasoning_content`
(streamed as `delta.reasoning_content`) and the rest in `content`, where tool calls are looked for, as vLLM's
reasoning parsers and llama.cpp's server do. A block counts when the reply starts with it, or when the
prompt opened it (templates that start the reply's thinking themselves, such as QwQ's and newer
DeepSeek-R1 ones, end the prompt with <think>); a block never closed (the length limit) is all reasoning.

The markers are found in the vocabulary: both spellings single tokens that decoding keeps. So whether the
prompt opened a block is read from its token ids, and the engine follows the block by its tokens
(SamplingParams.reasoning: a guide after it, a budget, the reasoning's length in tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from model.tokenizer import Tokenizer

# The spellings reasoning models use for their block (Qwen3, QwQ, DeepSeek-R1 and their distillations; Gemma
# 4; Magistral), and the text that opens the block before its reasoning.
MARKERS = (("<think>", "</think>", ""), ("<|channel>", "<channel|>", "thought"), ("[THINK]", "[/THINK]", ""))
PARSERS = ("auto", "none", "think", "harmony")  # harmony: GPT-OSS's analysis channel (server/harmony.py)
# vLLM's `--reasoning-parser` names for the same formats, taken as they are.
ALIASES = {"qwen3": "think", "deepseek_r1": "think", "gemma4": "think", "mistral": "think", "openai_gptoss": "harmony"}


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    start_id: int
    end_id: int
    lead: str = ""  # the block's name after its start marker (Gemma 4's "thought"), not reasoning

    @classmethod
    def find(cls, tokenizer: Tokenizer) -> ReasoningFormat | None:
        """The model's markers, if its vocabulary has them as single tokens that decoding keeps."""
        for start, end, lead in MARKERS:
            ids = tokenizer.token_to_id(start), tokenizer.token_to_id(end)
            if None not in ids and not set(ids) & tokenizer.special_ids:
                return cls(start, end, *ids, lead)
        return None

    @classmethod
    def for_server(cls, parser: str, tokenizer: Tokenizer) -> ReasoningFormat | None:
        """`--reasoning-parser`: auto (the markers if the vocabulary has them), none, or think (the markers,
        required). Raises ValueError, with the reason, for a parser this model cannot use."""
        parser = ALIASES.get(parser, parser)
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; one of {', '.join([*PARSERS, *ALIASES])}")
        if parser in ("none", "harmony"):  # harmony's analysis channel: server/harmony.py reads it
            return None
        found = cls.find(tokenizer)
        if found is None and parser == "think":
            raise ValueError("--reasoning-parser think needs <think> and </think> (or Gemma 4's <|channel> and "
                             "<channel|>) as single tokens of the model's vocabulary that decoding keeps; this "
                             "model's has no such pair")
        return found

    def opened_by(self, prompt_ids: Sequence[int]) -> bool:
        """Whether the prompt leaves a block open: its last marker is a start."""
        for token in reversed(prompt_ids):
            if token == self.end_id:
                return False
            if token == self.start_id:
                return True
        return False


@dataclass(frozen=True)
class Reasoning:
    """How one chat request's replies are read: the model's markers, whether its prompt opened a block, and
    whether the reasoning is returned (vLLM's `include_reasoning`; without it the block is still left out
    of `content`)."""

    fmt: ReasoningFormat
    opened: bool
    include: bool = True

    def split(self) -> ReasoningSplit:
        return ReasoningSplit(self.fmt, self.opened)

    def whole(self, text: str) -> tuple[str | None, str]:
        """A whole reply's reasoning (None without a block, or when not included) and content."""
        split = self.split()
        reasoning, content = split.push(text)
        more_reasoning, more_content = split.finish()
        has_block = split.inside or split.after is not None
        reasoning = reasoning + more_reasoning if has_block and self.include else None
        return reasoning, content + more_content


class ReasoningSplit:
    """One sample's text split as it grows: `push` takes each new piece of text and returns the reasoning
    and content it releases (the engine counts the block's tokens: SampleDelta.num_reasoning_tokens).
    Reasoning loses the newlines next to its markers and content its leading whitespace after a block, so a
    tail of newlines (and of a partly written marker) is held until what follows decides it. The pieces of
    a stream joined equal the whole text's split."""

    def __init__(self, fmt: ReasoningFormat, opened: bool) -> None:
        self.fmt = fmt
        self.text = ""
        self.decided = opened  # whether it is known if the reply has a block
        self.inside = opened  # in the block now
        self.body = 0  # where the block's text starts in `text`
        self.released = 0  # end of the reasoning released so far (an index into `text`)
        self.scanned = 0  # `text` before this is searched for the end marker already
        self.after: int | None = None  # where the text after the block starts
        self.content: int | None = None  # where content starts, once known
        self.content_sent = 0
        self.led = False  # the block's name (ReasoningFormat.lead) is decided

    def push(self, text: str, final: bool = False) -> tuple[str, str]:
        self.text += text
        start = self.fmt.start
        if not self.decided:
            if self.text.startswith(start):
                self.decided = self.inside = True
                self.body = self.released = self.scanned = len(start)
            elif start.startswith(self.text) and not final:
                return "", ""  # may still become the start marker
            else:
                self.decided, self.content = True, 0
        reasoning = ""
        if self.inside:
            reasoning = self._reasoning(final)
        if self.content is None and self.after is not None:
            rest = self.text[self.after:]
            stripped = rest.lstrip()
            if stripped:
                self.content = len(self.text) - len(stripped)
        if self.content is None:
            return reasoning, ""
        content = self.text[self.content + self.content_sent:]
        self.content_sent += len(content)
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """Everything held back, at the sample's end."""
        return self.push("", final=True)

    def _reasoning(self, final: bool) -> str:
        end = self.fmt.end
        found = self.text.find(end, max(self.body, self.scanned - len(end) + 1))
        self.scanned = len(self.text)
        if found >= 0:
            limit = found
            self.inside, self.after = False, found + len(end)
        else:
            limit = len(self.text) if final else len(self.text) - _partial_suffix(self.text, end, self.body)
        lead = self.fmt.lead
        if lead and self.released == self.body and not self.led:  # the block's name goes, once known
            head = self.text[self.body:limit if found >= 0 else len(self.text)]
            if lead.startswith(head) and len(head) < len(lead) and found < 0 and not final:
                return ""  # may still be the name
            self.led = True
            if head.startswith(lead):
                self.body = self.released = self.body + len(lead)
        if self.released == self.body:  # nothing out yet: the newlines after the start marker go
            while self.released < limit and self.text[self.released] == "\n":
                self.released += 1
            self.body = self.released
        while limit > self.released and self.text[limit - 1] == "\n":  # and those before the end
            limit -= 1
        piece = self.text[self.released:limit]
        self.released = max(self.released, limit)
        return piece


def _partial_suffix(text: str, marker: str, floor: int) -> int:
    """The length of the longest tail of `text` (after `floor`) that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text) - floor), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
