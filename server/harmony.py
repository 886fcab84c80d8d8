"""GPT-OSS's replies (OpenAI's harmony format) read as reasoning, content and tool calls.

A harmony reply is a run of messages, each a header then a body:

    <|channel|>analysis<|message|>Let me think.<|end|>
    <|start|>assistant<|channel|>final<|message|>Blue.<|return|>

    <|start|>assistant<|channel|>commentary to=functions.weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>

(the prompt ends with `<|start|>assistant`, so the first header arrives without it; `to=` may also come before
`<|channel|>`). `<|end|>` closes a message without ending the reply, and decoding drops it, so a message ends where
the next header starts (`<|start|>` or `<|channel|>`); `<|return|>` and `<|call|>` end the reply (stop tokens).

`HarmonySplit` reads such text as it grows, with ReasoningSplit's interface (server/reasoning.py): the analysis
channel's bodies are reasoning; the final and commentary channels' bodies are content, their headers gone; a
message to a function (`to=functions.NAME`) goes into the content as one canonical call,
`<|channel|>commentary to=functions.NAME<|message|>ARGUMENTS<|call|>`, which the HARMONY tool format
(server/tool_calls.py) reads as a call. Text that does not open with a header is content as it is. The pieces of
a stream joined equal the whole text's split.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.guide import Guide

START, CHANNEL, MESSAGE, CONSTRAIN, CALL = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|call|>"
FUNCTIONS = "functions."
# The header the generation prompt begins: the reply starts its first message's channel.
HARMONY_REPLY = f"{START}assistant"
# Where a canonical call starts, and its close (server/tool_calls.py ToolFormat.HARMONY's tags).
CALL_OPEN = f"{CHANNEL}commentary to={FUNCTIONS}"
# The markers a harmony vocabulary has, which decoding must keep (model/tokenizer.py VISIBLE_MARKERS).
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
# A header longer than this, or holding a newline, is text that only looked like one.
MAX_HEADER = 256


@dataclass(frozen=True)
class HarmonyFormat:
    """A model that speaks harmony: its vocabulary has the markers as tokens that decoding keeps."""

    start_id: int
    end_id: int | None = None  # <|end|>, which closes the analysis: a guide's answer waits for it

    @classmethod
    def find(cls, tokenizer) -> HarmonyFormat | None:
        ids = [tokenizer.token_to_id(marker) for marker in MARKERS]
        if None in ids or set(ids) & tokenizer.special_ids:
            return None
        return cls(ids[0], tokenizer.token_to_id("<|end|>"))

    def guide_answer(self, guide: Guide, forced_call: bool) -> Guide:
        """A request's guide for the answer after the analysis (engine/guide.py `Guide.after_analysis`): behind
        the final channel's header, or for a forced call (whose grammar writes its own message) behind nothing.
        A grammar of the request's own (Lark, GBNF) spells the whole reply itself and is left as it is."""
        if self.end_id is None or guide.kind in ("lark", "gbnf") and not forced_call:
            return guide
        return Guide.after_analysis(guide, self.end_id, "" if forced_call else f"{CHANNEL}final{MESSAGE}")

    def prefix_of(self, prompt_ids: list[int], tokenizer) -> str:
        """The header the prompt has begun (`<|start|>assistant` from the generation prompt), as text: the
        prompt's last message from its last `<|start|>`, when that message has no body yet."""
        for back, token in enumerate(reversed(prompt_ids)):
            if token == self.start_id:
                tail = tokenizer.decode(prompt_ids[len(prompt_ids) - back - 1:], skip_special_tokens=True)
                return "" if MESSAGE in tail else tail
        return ""


@dataclass(frozen=True)
class HarmonyReasoning:
    """How one chat request's harmony replies are read (server/reasoning.py Reasoning's interface): the header
    its prompt began, and whether the analysis is returned."""

    prefix: str = ""
    include: bool = True

    def split(self) -> HarmonySplit:
        return HarmonySplit(self.prefix)

    def whole(self, text: str) -> tuple[str | None, str]:
        split = self.split()
        reasoning, content = split.push(text, final=True)
        return (reasoning if split.analysed and self.include else None), content


class HarmonySplit:
    """One sample's harmony text split as it grows: `push` returns the reasoning and content it releases."""

    def __init__(self, prefix: str = "") -> None:
        self.text = prefix
        self.prompted = len(prefix)  # the text before this is the prompt's, never released
        self.at = 0  # where the unread text starts
        self.in_body = False
        self.channel: str | None = None
        self.recipient: str | None = None
        self.analysed = False  # the reply had an analysis message

    def push(self, text: str, final: bool = False) -> tuple[str, str]:
        self.text += text
        reasoning, content = [], []
        while True:
            if self.in_body:
                if not self._body(reasoning, content, final):
                    break
            elif not self._header(content, final):
                break
        if final and self.in_body and self._calls():
            content.append(CALL)
            self.in_body = False
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        return self.push("", final=True)

    def _calls(self) -> bool:
        return self.recipient is not None and self.recipient.startswith(FUNCTIONS)

    def _header(self, content: list[str], final: bool) -> bool:
        """Read a header from `at`; True when a body (or plain text) follows and reading goes on."""
        rest = self.text[self.at:]
        if not rest:
            return False
        opens = rest.startswith((START, CHANNEL))
        if not opens and (START.startswith(rest) or CHANNEL.startswith(rest)) and not final:
            return False  # may still open a header
        end = rest.find(MESSAGE) if opens else -1
        header = rest[:end] if end >= 0 else rest
        # Where a header stops being one: its first newline, or past MAX_HEADER characters.
        newline = header.find("\n")
        broken = min(newline + 1 if newline >= 0 else len(header) + 1, MAX_HEADER + 1)
        if opens and end >= 0 and broken > len(header):
            recipient, channel = _RECIPIENT.search(header), _CHANNEL.search(header)
            self.recipient = recipient.group(1) if recipient else None
            self.channel = channel.group(1) if channel else "final"
            self.at += end + len(MESSAGE)
            self.in_body = True
            if self.channel == "analysis" and self.recipient is None:
                self.analysed = True
            elif self._calls():
                content.append(f"{CALL_OPEN}{self.recipient.removeprefix(FUNCTIONS)}{MESSAGE}")
            return True
        if opens and broken > len(header) and not final:
            return False  # the header is still arriving
        # Not a header after all: the text is content as it is (a reply without harmony's markup), what
        # looked like a header up to where it stopped being one, the prompt's part of it excepted.
        self.channel, self.recipient, self.in_body = "final", None, True
        if opens:
            taken = min(broken, len(rest))
            content.append(self.text[max(self.at, self.prompted):self.at + taken])
            self.at += taken
        return True

    def _body(self, reasoning: list[str], content: list[str], final: bool) -> bool:
        """Release the body from `at` up to the next header; True when a header follows."""
        rest = self.text[self.at:]
        ends = [i for i in (rest.find(START), rest.find(CHANNEL)) if i >= 0]
        stop = min(ends) if ends else len(rest) - (0 if final else _partial_suffix(rest))
        piece = rest[:stop]
        self.at += stop
        if piece:
            (reasoning if self.channel == "analysis" and self.recipient is None else content).append(piece)
        if not ends:
            return False
        if self._calls():
            content.append(CALL)
        self.in_body = False
        self.channel = self.recipient = None
        return True


def _partial_suffix(text: str) -> int:
    """The length of the longest end of `text` that may begin a header marker."""
    for size in range(min(len(text), len(CHANNEL) - 1), 0, -1):
        tail = text[-size:]
        if START.startswith(tail) or CHANNEL.startswith(tail):
            return size
    return 0
