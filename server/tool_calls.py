"""OpenAI tool calling in a model's own format: which format a chat template speaks, the messages and
template variables that show it the tools, the calls parsed out of its reply (whole or streamed), and a
grammar that forces a call.

Seven formats cover the families ladder serves (docs/tool_calling.md):

- HERMES (Qwen 2/2.5/3, Hermes): the template renders tools, calls and results itself; a call is
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.
- GEMMA4 (Gemma 4): the template renders them itself; a call is ``<|tool_call>call:NAME{key:value,...}<tool_call|>``
  in Gemma's own notation: bare keys, strings between ``<|"|>`` quotes, numbers, booleans, lists and objects.
- LLAMA3 (Llama 3.1/3.2/3.3): the template renders them itself; a call is the bare JSON object
  ``{"name": ..., "parameters": {...}}``, perhaps after ``<|python_tag|>``, several joined by ``;``.
- MISTRAL (Mistral Small 3.x, Devstral, Ministral 3, Magistral, Mistral Nemo): the template renders them
  itself; calls follow ``[TOOL_CALLS]`` to the end of the reply: ``NAME[ARGS]{...}`` each (perhaps with
  ``[CALL_ID]id`` before ``[ARGS]``), or, from older templates, a JSON list of ``{"name", "arguments"}``.
- HARMONY (GPT-OSS): the template renders them itself; a call is a message to the function,
  ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}``, which server/harmony.py's split
  of the reply turns into ``<|channel|>commentary to=functions.NAME<|message|>{...}<|call|>`` for the parser here.
- QWEN_XML (Qwen3.5, Qwen3-Coder): the template renders them itself; a call is XML-like, each argument a bare
  value: ``<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>``;
  values are read by the tool's parameter schema (a string's text as it is, numbers, booleans, objects and arrays
  as JSON), so parsing takes the request's tools.
- DEFAULT (any other template, e.g. SmolLM2's plain ChatML): ladder lists the tools in a system message
  and asks for HERMES's wire format; calls and results become plain text turns.
"""

from __future__ import annotations

import enum
import json
import re
import secrets
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from server.gemma4_call_grammar import gemma4_call_grammar
from server.harmony import CALL as HARMONY_CLOSE
from server.harmony import CALL_OPEN as HARMONY_OPEN
from server.harmony import CHANNEL as HARMONY_CHANNEL
from server.harmony import MESSAGE as HARMONY_MESSAGE

__all__ = ["ToolFormat", "ToolCall", "StreamPiece", "ToolCallStream", "tool_format", "prepare_chat",
           "default_tool_prompt", "parse_tool_calls", "tool_call_grammar", "new_call_id"]

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
GEMMA4_OPEN, GEMMA4_CLOSE, GEMMA4_QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
QWEN_FUNCTION = "<function="
_QWEN_CALL = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
# A parameter's value sits on lines of its own: the newlines around it are the notation's, not the value's.
_QWEN_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
NO_PARAMETERS = {"type": "object", "properties": {}}
# A call (or several) that the tagged formats write; an unclosed last call counts when its JSON is whole
# (a reply cut at the stop token, or a model that omits the closing tag).
_TAGGED_CALL = re.compile(f"{CALL_OPEN}(.*?){CALL_CLOSE}|{CALL_OPEN}(.*)", re.DOTALL)
_GEMMA4_CALL = re.compile(f"{re.escape(GEMMA4_OPEN)}(.*?){re.escape(GEMMA4_CLOSE)}|{re.escape(GEMMA4_OPEN)}(.*)",
                          re.DOTALL)
_HARMONY_CALL = re.compile(f"{re.escape(HARMONY_OPEN)}(.*?){re.escape(HARMONY_CLOSE)}|{re.escape(HARMONY_OPEN)}(.*)",
                           re.DOTALL)
_SPACE, _SEMICOLON = re.compile(r"\s*"), re.compile(r"\s*;\s*")  # before Llama 3's first call, between calls
_ID_ALPHABET = string.ascii_letters + string.digits


class ToolFormat(enum.Enum):
    HERMES = "hermes"
    LLAMA3 = "llama3"
    GEMMA4 = "gemma4"
    MISTRAL = "mistral"
    HARMONY = "harmony"
    QWEN_XML = "qwen_xml"
    DEFAULT = "default"

    @property
    def tags(self) -> tuple[str, str]:
        """The open and close tags around one call (HERMES's, which the DEFAULT prompt asks for, Gemma 4's, or
        the canonical harmony call's)."""
        if self is ToolFormat.GEMMA4:
            return GEMMA4_OPEN, GEMMA4_CLOSE
        return (HARMONY_OPEN, HARMONY_CLOSE) if self is ToolFormat.HARMONY else (CALL_OPEN, CALL_CLOSE)


def new_call_id(fmt: ToolFormat | None = None) -> str:
    """An id for a call. MISTRAL's: 9 letters and digits, the only ids Mistral's templates accept back."""
    if fmt is ToolFormat.MISTRAL:
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object

    @classmethod
    def new(cls, name: str, arguments: str, fmt: ToolFormat | None = None) -> ToolCall:
        return cls(new_call_id(fmt), name, arguments)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def tool_format(chat_template: str | None) -> ToolFormat:
    """The format a chat template speaks. A template that renders tools some other way gets DEFAULT:
    ladder's own prompt asks for a format that ladder parses."""
    template = chat_template or ""
    if HARMONY_CHANNEL in template and HARMONY_MESSAGE in template:
        return ToolFormat.HARMONY
    if GEMMA4_OPEN in template:
        return ToolFormat.GEMMA4
    if MISTRAL_CALLS in template:
        return ToolFormat.MISTRAL
    if CALL_OPEN in template and QWEN_FUNCTION in template:
        return ToolFormat.QWEN_XML
    if CALL_OPEN in template:
        return ToolFormat.HERMES
    if PYTHON_TAG in template or "ipython" in template:  # "Environment: ipython" in 3.1, 3.2 and 3.3
        return ToolFormat.LLAMA3
    return ToolFormat.DEFAULT


# -- prompts -----------------------------------------------------------------------------------


def prepare_chat(messages: Sequence[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                 fmt: ToolFormat) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages to render and the extra template variables, for OpenAI-shaped ``messages`` and
    ``tools``. Without tools and without tool turns the messages pass unchanged."""
    tools = list(tools or ())
    if not tools and not any(_is_tool_turn(m) for m in messages):
        return list(messages), {}
    if fmt is ToolFormat.DEFAULT:
        return _default_messages(messages, tools), {}
    if fmt is ToolFormat.HARMONY:  # GPT-OSS's template reads a call's analysis as `thinking`
        messages = [{**m, "thinking": m["reasoning_content"]} if m.get("tool_calls") and m.get("reasoning_content")
                     else m for m in messages]
    return [_for_template(m) for m in messages], ({"tools": tools} if tools else {})


def default_tool_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system text that shows the tools to a model whose template knows nothing of them."""
    listed = "\n".join(json.dumps(_function_for_prompt(t), ensure_ascii=False) for t in tools)
    return (
        "You can call tools (functions) to help with the user's request. These are the tools, one JSON object "
        f"a line:\n<tools>\n{listed}\n</tools>\n\n"
        "To call a tool, reply with its name and its arguments as a JSON object inside <tool_call></tool_call> "
        "tags, one block per call:\n"
        f'{CALL_OPEN}\n{{"name": <tool name>, "arguments": <arguments as a JSON object>}}\n{CALL_CLOSE}\n'
        f"Each result comes back to you inside {RESPONSE_OPEN}{RESPONSE_CLOSE} tags. "
        "When no tool is needed, reply in plain text."
    )


def _is_tool_turn(message: Mapping[str, Any]) -> bool:
    return message.get("role") == "tool" or bool(message.get("tool_calls"))


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    """A message for a template that renders tool turns itself. Such templates write a call's arguments
    with ``| tojson`` (Qwen 2.5, Llama 3.1), so they get the parsed object, not its JSON text: text would be
    quoted a second time. Content None becomes "": some templates concatenate it."""
    if not message.get("tool_calls"):
        return message
    calls = [{**call, "function": {**call["function"], "arguments": _json_or_text(call["function"]["arguments"])}}
             for call in message["tool_calls"]]
    return {**message, "content": message.get("content") or "", "tool_calls": calls}


def _default_messages(messages: Sequence[dict[str, Any]], tools: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Plain system/user/assistant turns with string content: the default template concatenates
    ``message['content']`` and knows no other roles or keys."""
    out: list[dict[str, Any]] = []
    previous_was_tool = False
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if role == "tool":
            block = f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}"
            if previous_was_tool:  # the results of one turn's calls answer together, as one user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        elif message.get("tool_calls"):
            blocks = [_tagged_call(call["function"]) for call in message["tool_calls"]]
            text = "\n".join([content, *blocks] if content else blocks)
            out.append({k: v for k, v in message.items() if k != "tool_calls"} | {"content": text})
        else:
            out.append({**message, "content": content})
        previous_was_tool = role == "tool"
    if tools:
        prompt = default_tool_prompt(tools)
        if out and out[0].get("role") == "system":
            system = out[0]["content"]
            out[0] = {**out[0], "content": f"{prompt}\n\n{system}" if system else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _tagged_call(function: Mapping[str, Any]) -> str:
    call = {"name": function["name"], "arguments": _json_or_text(function["arguments"])}
    return f"{CALL_OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{CALL_CLOSE}"


def _function_for_prompt(tool: Mapping[str, Any]) -> dict[str, Any]:
    function = tool["function"]
    shown = {"name": function["name"]}
    if function.get("description"):
        shown["description"] = function["description"]
    shown["parameters"] = function.get("parameters") or NO_PARAMETERS
    return shown


def _json_or_text(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text  # arguments that were never JSON are shown as the text they were


# -- parsing -----------------------------------------------------------------------------------


def parse_tool_calls(text: str, fmt: ToolFormat,
                     tools: Sequence[Mapping[str, Any]] = ()) -> tuple[str | None, list[ToolCall]]:
    """The content outside the calls (None when only whitespace) and the calls of a finished reply. A
    call that does not parse (bad JSON, no name, arguments not an object) stays in the content. `tools`: the
    request's (OpenAI-shaped), whose schemas type QWEN_XML's bare values."""
    content, calls = _parse_whole(text, fmt, tools)
    return (content if content.strip() else None), calls


def _parse_whole(text: str, fmt: ToolFormat, tools: Sequence[Mapping[str, Any]] = ()) -> tuple[str, list[ToolCall]]:
    if fmt is ToolFormat.LLAMA3:
        return _parse_llama3(text)
    if fmt is ToolFormat.MISTRAL:
        return _parse_mistral(text)
    return _parse_tagged(text, fmt, tools)


def _parse_mistral(text: str) -> tuple[str, list[ToolCall]]:
    """Each ``[TOOL_CALLS]`` segment (to the next one, or the end) holds calls; one that does not parse
    whole stays in the content with its marker."""
    first = text.find(MISTRAL_CALLS)
    if first < 0:
        return text, []
    kept, calls = [text[:first]], []
    segments = text[first + len(MISTRAL_CALLS):].split(MISTRAL_CALLS)
    for segment in segments:
        parsed = _mistral_segment(segment)
        if parsed is None:
            kept.append(MISTRAL_CALLS + segment)
        else:
            calls.extend(parsed)
    return "".join(kept), calls


def _mistral_segment(segment: str) -> list[ToolCall] | None:
    """``NAME[ARGS]{...}`` (one or more, ``[CALL_ID]id`` allowed before ``[ARGS]``) or a JSON list of calls;
    None unless the whole segment is that."""
    decoder = json.JSONDecoder(parse_constant=_refuse_constant)
    body = segment.strip()
    try:
        if body.startswith("["):  # the older templates' list of {"name": ..., "arguments": {...}}
            value, end = decoder.raw_decode(body)
            listed = [_call_from_value(v, require_arguments=False) for v in value] if isinstance(value, list) else []
            ok = listed and all(listed) and not body[end:].strip()
            return [ToolCall.new(c.name, c.arguments, ToolFormat.MISTRAL) for c in listed] if ok else None
        calls, at = [], 0
        while at < len(body):
            args = body.find(MISTRAL_ARGS, at)
            if args < 0:
                return None
            name = body[at:args].split(MISTRAL_ID)[0].strip()
            value, at = decoder.raw_decode(body, args + len(MISTRAL_ARGS))
            if not name or not isinstance(value, dict):
                return None
            calls.append(ToolCall.new(name, json.dumps(value, ensure_ascii=False), ToolFormat.MISTRAL))
            at = len(body) - len(body[at:].lstrip())
        return calls or None
    except (ValueError, RecursionError):
        return None


def _parse_tagged(text: str, fmt: ToolFormat, tools: Sequence[Mapping[str, Any]] = ()) -> tuple[str, list[ToolCall]]:
    kept, calls, start = [], [], 0
    pattern = {ToolFormat.GEMMA4: _GEMMA4_CALL, ToolFormat.HARMONY: _HARMONY_CALL}.get(fmt, _TAGGED_CALL)
    for match in pattern.finditer(text):
        body = match.group(1) if match.group(1) is not None else match.group(2)
        call = _call_from_body(body, fmt, tools)
        if call is not None:
            kept.append(text[start:match.start()])
            calls.append(call)
            start = match.end()
    kept.append(text[start:])
    return "".join(kept), calls


def _parse_llama3(text: str) -> tuple[str, list[ToolCall]]:
    body = text.lstrip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):]
    elif not body.startswith("{"):
        return text, []
    decoder = json.JSONDecoder(parse_constant=_refuse_constant)
    calls: list[ToolCall] = []
    end = 0  # where the last call's text ends
    while True:
        gap = (_SEMICOLON if calls else _SPACE).match(body, end)
        if gap is None:
            break
        try:
            value, after = decoder.raw_decode(body, gap.end())
        except (ValueError, RecursionError):
            break
        # A bare JSON reply with a "name" key is not a call unless it has arguments too: Llama 3 always
        # writes "parameters", and ordinary JSON answers are common in this format.
        call = _call_from_value(value, require_arguments=True)
        if call is None:
            break
        calls.append(call)
        end = after
    if not calls:
        return text, []
    return text[: len(text) - len(text.lstrip())] + body[end:], calls


def _call_from_body(body: str, fmt: ToolFormat, tools: Sequence[Mapping[str, Any]] = ()) -> ToolCall | None:
    """A tagged call's body in the format's notation, or None when it does not parse."""
    if fmt is ToolFormat.GEMMA4:
        return _call_from_gemma4(body)
    if fmt is ToolFormat.HARMONY:
        return _call_from_harmony(body)
    if fmt is ToolFormat.QWEN_XML:
        return _call_from_qwen_xml(body, tools)
    return _call_from_json(body, require_arguments=False)


def _call_from_qwen_xml(body: str, tools: Sequence[Mapping[str, Any]]) -> ToolCall | None:
    """``<function=NAME><parameter=KEY>VALUE</parameter>...</function>`` -> a call, each value typed by the named
    tool's schema (`_typed_value`); None when anything but whitespace lies outside the parameters."""
    match = _QWEN_CALL.fullmatch(body)
    if match is None:
        return None
    name, inner = match.group(1).strip(), match.group(2)
    properties = next((((t.get("function") or {}).get("parameters") or {}).get("properties") or {}
                       for t in tools if (t.get("function") or {}).get("name") == name), {})
    arguments, end = {}, 0
    for parameter in _QWEN_PARAMETER.finditer(inner):
        if inner[end:parameter.start()].strip():
            return None
        key = parameter.group(1).strip()
        arguments[key] = _typed_value(parameter.group(2), properties.get(key))
        end = parameter.end()
    if not name or inner[end:].strip():
        return None
    return ToolCall.new(name, json.dumps(arguments, ensure_ascii=False))


def _typed_value(text: str, schema: Mapping[str, Any] | None) -> Any:
    """A bare value as its parameter's schema types it: a string (or a parameter the tool does not declare) is its
    text; an integer, number, boolean, null, object or array is read as JSON (Python's True, False and None too:
    the template writes a past call's values with Jinja's `string`), and stays text where it does not parse."""
    kinds = (schema or {}).get("type", "string" if schema is None else None)
    kinds = {kinds} if isinstance(kinds, str) else set(kinds or ())
    if "string" in kinds or (schema is not None and not kinds and "enum" in schema and
                             all(isinstance(v, str) for v in schema["enum"])):
        return text
    word = text.strip()
    word = {"True": "true", "False": "false", "None": "null"}.get(word, word)
    try:
        return json.loads(word, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        return text


def _call_from_harmony(body: str) -> ToolCall | None:
    """``NAME<|message|>{...}`` (a canonical harmony call's inside) -> a call, when the arguments are an object."""
    name, found, arguments = body.partition(HARMONY_MESSAGE)
    try:
        value = json.loads(arguments, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        return None
    if not found or not name.strip() or not isinstance(value, dict):
        return None
    return ToolCall.new(name.strip(), json.dumps(value, ensure_ascii=False))


_GEMMA4_HEAD = re.compile(r"\s*call:([^{\s]+)\s*")


def _call_from_gemma4(body: str) -> ToolCall | None:
    """``call:NAME{key:value,...}`` (Gemma 4's notation) -> a call whose arguments are that object as JSON."""
    head = _GEMMA4_HEAD.match(body)
    if head is None:
        return None
    try:
        arguments, end = _gemma4_value(body, head.end())
    except (ValueError, IndexError, RecursionError):
        return None
    if not isinstance(arguments, dict) or body[end:].strip():
        return None
    return ToolCall.new(head.group(1), json.dumps(arguments, ensure_ascii=False))


def _gemma4_value(text: str, i: int) -> tuple[Any, int]:
    """The value of Gemma 4's notation at text[i:] and where it ends: ``<|"|>``-quoted strings, ``{key:value,
    ...}`` objects with bare keys, ``[value, ...]`` lists, and bare numbers, true, false and null (a bare word
    that is none of them is a string). ValueError where the text is not that notation."""
    i = _skip_space(text, i)
    if text.startswith(GEMMA4_QUOTE, i):
        end = text.index(GEMMA4_QUOTE, i + len(GEMMA4_QUOTE))
        return text[i + len(GEMMA4_QUOTE):end], end + len(GEMMA4_QUOTE)
    if text[i] in "{[":
        closing, items, obj = ("}" if text[i] == "{" else "]"), [], {}
        i = _skip_space(text, i + 1)
        while text[i] != closing:
            if closing == "}":
                colon = text.index(":", i)
                key = text[i:colon].strip()
                if key.startswith(GEMMA4_QUOTE) and key.endswith(GEMMA4_QUOTE) and len(key) > 2 * len(GEMMA4_QUOTE):
                    key = key[len(GEMMA4_QUOTE):-len(GEMMA4_QUOTE)]
                if not key:
                    raise ValueError("an empty key")
                obj[key], i = _gemma4_value(text, colon + 1)
            else:
                value, i = _gemma4_value(text, i)
                items.append(value)
            i = _skip_space(text, i)
            if text[i] == ",":
                i = _skip_space(text, i + 1)
            elif text[i] != closing:
                raise ValueError(f"expected ',' or {closing!r}")
        return (obj if closing == "}" else items), i + 1
    end = i
    while end < len(text) and text[end] not in ",}]":
        end += 1
    word = text[i:end].strip()
    if not word:
        raise ValueError("a missing value")
    try:
        value = json.loads(word, parse_constant=_refuse_constant)
    except ValueError:
        value = word  # an unquoted word: its text
    return value, end


def _skip_space(text: str, i: int) -> int:
    while text[i].isspace():
        i += 1
    return i


def _call_from_json(body: str, require_arguments: bool) -> ToolCall | None:
    try:
        value = json.loads(body, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        return None
    return _call_from_value(value, require_arguments)


def _call_from_value(value: Any, require_arguments: bool) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    key = "arguments" if "arguments" in value else "parameters"
    if key not in value and require_arguments:
        return None
    arguments = value.get(key, {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text, as OpenAI sends them
        arguments = _json_or_text(arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall.new(value["name"], json.dumps(arguments, ensure_ascii=False))


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN and Infinity would be re-serialized as invalid JSON


# -- streaming ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamPiece:
    content: str  # text safe to send now
    calls: list[ToolCall] = field(default_factory=list)  # calls completed in this piece


class ToolCallStream:
    """Splits one choice's streamed text into content and tool calls. Text that may begin a call is
    held back until it is decided, so what was sent is never taken back: the pieces' content joined is
    ``parse_tool_calls(whole text)``'s content (or only whitespace where that is None), and their calls
    are its calls.

    Leading whitespace is held until some content follows: a reply made only of calls sends no content.
    A reply without calls sends exactly its text. LLAMA3 decides on the reply's first character: if it
    opens a call, the whole reply is held and parsed at the end."""

    def __init__(self, fmt: ToolFormat, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        self.fmt = fmt
        self.tools = tools  # the request's, whose schemas type QWEN_XML's values
        self._pending = ""  # received, not yet sent nor parsed
        self._searched = 0  # the close tag is not in _pending[:_searched] (a call held open)
        self._space = ""  # leading whitespace not yet sent
        self._has_content = False
        self._made_calls = False
        self._llama3_holds: bool | None = None  # LLAMA3: None while the reply's start is undecided

    def push(self, text: str) -> StreamPiece:
        self._pending += text
        if self.fmt is ToolFormat.LLAMA3:
            return self._push_llama3()
        if self.fmt is ToolFormat.MISTRAL:
            return self._push_mistral()
        kept, calls = [], []
        opening, closing = self.fmt.tags
        while True:
            start = self._pending.find(opening)
            if start < 0:
                hold = _partial_suffix(self._pending, opening)
                kept.append(self._pending[: len(self._pending) - hold])
                self._pending = self._pending[len(self._pending) - hold:]
                break
            kept.append(self._pending[:start])
            self._pending = self._pending[start:]
            end = self._pending.find(closing, max(len(opening), self._searched - len(closing) + 1))
            if end < 0:
                self._searched = len(self._pending)
                break
            self._searched = 0
            block_end = end + len(closing)
            call = _call_from_body(self._pending[len(opening):end], self.fmt, self.tools)
            if call is None:
                kept.append(self._pending[:block_end])
            else:
                calls.append(call)
            self._pending = self._pending[block_end:]
        return self._piece("".join(kept), calls)

    def finish(self) -> StreamPiece:
        """Everything still held: an unclosed call (a call if its JSON is whole) or text."""
        rest, self._pending = self._pending, ""
        content, calls = _parse_whole(rest, self.fmt, self.tools)
        piece = self._piece(content, calls)
        if self._made_calls or not self._space:
            return piece
        space, self._space = self._space, ""  # no calls at all: the reply was its text, whitespace too
        return StreamPiece(piece.content + space, piece.calls)

    def _push_llama3(self) -> StreamPiece:
        if self._llama3_holds is None:
            start = self._pending.lstrip()
            if not start or PYTHON_TAG.startswith(start):
                return StreamPiece("")
            self._llama3_holds = start.startswith(("{", PYTHON_TAG))
        if self._llama3_holds:
            return StreamPiece("")
        text, self._pending = self._pending, ""
        return self._piece(text, [])

    def _push_mistral(self) -> StreamPiece:
        """Text before ``[TOOL_CALLS]`` is sent as it comes; from the marker on, the reply is held and its
        calls are read at the end (they run to it)."""
        start = self._pending.find(MISTRAL_CALLS)
        if start >= 0:
            text, self._pending = self._pending[:start], self._pending[start:]
        else:
            hold = _partial_suffix(self._pending, MISTRAL_CALLS)
            text, self._pending = self._pending[: len(self._pending) - hold], self._pending[len(self._pending) - hold:]
        return self._piece(text, [])

    def _piece(self, text: str, calls: list[ToolCall]) -> StreamPiece:
        self._made_calls = self._made_calls or bool(calls)
        if text and not self._has_content:
            self._space += text
            if self._space.isspace():
                text = ""
            else:
                text, self._space, self._has_content = self._space, "", True
        return StreamPiece(text, calls)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (and is shorter than it)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


# -- grammar -----------------------------------------------------------------------------------

# JSON inside a forced call is written with json.dumps's separators and no other whitespace: a fixed
# spelling leaves a small model no whitespace to loop on, and it is the spelling of the calls that the
# templates (``| tojson``) and the default prompt show the model.
_JSON_SPELLING = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], name: str | None, parallel: bool,
                      fmt: ToolFormat) -> str:
    """A grammar in llguidance's Lark dialect for a reply that is one call (one or more when
    ``parallel``) in ``fmt``, to one of ``tools`` (exactly ``name`` when given), with arguments valid
    against that tool's parameters schema. Raises ValueError when no tool is named ``name``."""
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not functions:
        raise ValueError(f"no tool is named {name!r}" if name is not None else "a forced tool call needs tools")
    if fmt is ToolFormat.GEMMA4:
        return gemma4_call_grammar(functions, parallel)
    if fmt is ToolFormat.MISTRAL:
        return _mistral_call_grammar(functions, parallel)
    if fmt is ToolFormat.HARMONY:
        return _harmony_call_grammar(functions, parallel)
    if fmt is ToolFormat.QWEN_XML:
        return _qwen_xml_call_grammar(functions, parallel)
    if fmt is ToolFormat.LLAMA3:
        before, after, separator, key = "", "", ";", "parameters"
    else:
        before, after, separator, key = f"{CALL_OPEN}\n", f"\n{CALL_CLOSE}", "\n", "arguments"
    lines = [f"start: call ({_lark_literal(separator)} call)*" if parallel else "start: call",
             "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    for i, function in enumerate(functions):
        # The name is a literal and only the arguments are a %json rule: the parameters schema stays the
        # root of its own JSON schema, so its "$ref": "#/$defs/..." still resolve.
        head = f'{before}{{"name": {json.dumps(function["name"], ensure_ascii=False)}, "{key}": '
        lines.append(f"call_{i}: {_lark_literal(head)} arguments_{i} {_lark_literal('}' + after)}")
        lines.append(f"arguments_{i}: %json {json.dumps(_arguments_schema(function), ensure_ascii=False)}")
    return "\n".join(lines) + "\n"


def _mistral_call_grammar(functions: Sequence[Mapping[str, Any]], parallel: bool) -> str:
    """``[TOOL_CALLS]NAME[ARGS]{...}``, back to back when ``parallel``, as Mistral's templates write calls;
    ``[CALL_ID]`` and an id of 9 letters and digits may come before ``[ARGS]``, as Mistral Small 3.2's does."""
    lines = ["start: call call*" if parallel else "start: call",
             "call: " + " | ".join(f"call_{i}" for i in range(len(functions))),
             f"call_id: ({_lark_literal(MISTRAL_ID)} /[A-Za-z0-9]{{9}}/)?"]
    for i, function in enumerate(functions):
        head = _lark_literal(MISTRAL_CALLS + function["name"])
        lines.append(f"call_{i}: {head} call_id {_lark_literal(MISTRAL_ARGS)} arguments_{i}")
        lines.append(f"arguments_{i}: %json {json.dumps(_arguments_schema(function), ensure_ascii=False)}")
    return "\n".join(lines) + "\n"


def _harmony_call_grammar(functions: Sequence[Mapping[str, Any]], parallel: bool) -> str:
    """A message to the function, as GPT-OSS writes a call after its generation prompt (``<|start|>assistant``):
    ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}``; with ``parallel``, more
    calls each in a message of its own."""
    lines = [f'start: call ({_lark_literal("<|start|>assistant")} call)*' if parallel else "start: call",
             "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    for i, function in enumerate(functions):
        head = f"{HARMONY_OPEN}{function['name']} <|constrain|>json{HARMONY_MESSAGE}"
        lines.append(f"call_{i}: {_lark_literal(head)} arguments_{i}")
        lines.append(f"arguments_{i}: %json {json.dumps(_arguments_schema(function), ensure_ascii=False)}")
    return "\n".join(lines) + "\n"


def _qwen_xml_call_grammar(functions: Sequence[Mapping[str, Any]], parallel: bool) -> str:
    """``<tool_call>\n<function=NAME>\n`` then the parameters, ``</function>\n</tool_call>``, as Qwen3.5's template
    writes a call (several on lines of their own when ``parallel``). Each parameter is
    ``<parameter=KEY>\nVALUE\n</parameter>\n``: the required ones in the schema's order, then each optional one
    or not; a string value is text without ``<``, an enum's one of its values, any other type JSON valid against
    its schema."""
    lines = [r'start: call ("\n" call)*' if parallel else "start: call",
             "call: " + " | ".join(f"call_{i}" for i in range(len(functions))),
             r'TEXT: /[^<]*\n<\/parameter>\n/']
    for i, function in enumerate(functions):
        schema = _arguments_schema(function)
        properties = schema.get("properties") or {}
        required = [key for key in properties if key in (schema.get("required") or ())]
        parts = [f"p_{i}_{j}" if key in required else f"p_{i}_{j}?" for j, key in enumerate(properties)]
        head = f"{CALL_OPEN}\n{QWEN_FUNCTION}{function['name']}>\n"
        tail = _lark_literal("</function>\n" + CALL_CLOSE)
        lines.append(f"call_{i}: {_lark_literal(head)} {' '.join(parts)} {tail}")
        for j, (key, value) in enumerate(properties.items()):
            open_ = _lark_literal(f"<parameter={key}>\n")
            kinds = value.get("type")
            if "enum" in value and all(isinstance(v, str) for v in value["enum"]):
                options = " | ".join(_lark_literal(f"{v}\n</parameter>\n") for v in value["enum"])
                lines.append(f"p_{i}_{j}: {open_} ({options})")
            elif kinds == "string" or (isinstance(kinds, list) and "string" in kinds):
                lines.append(f"p_{i}_{j}: {open_} TEXT")
            else:
                sub = {**value, "x-guidance": schema["x-guidance"]}
                lines.append(f"p_{i}_{j}: {open_} value_{i}_{j} {_lark_literal(chr(10) + '</parameter>' + chr(10))}")
                lines.append(f"value_{i}_{j}: %json {json.dumps(sub, ensure_ascii=False)}")
    return "\n".join(lines) + "\n"


def _arguments_schema(function: Mapping[str, Any]) -> dict[str, Any]:
    schema = dict(function.get("parameters") or NO_PARAMETERS)
    schema.setdefault("type", "object")  # parse_tool_calls takes only an object as arguments
    # A strict tool's schema must be followed exactly, so a keyword llguidance does not implement is an
    # error; otherwise such a keyword is ignored and the rest of the schema still holds.
    own = schema.get("x-guidance")
    schema["x-guidance"] = {**(own if isinstance(own, dict) else {}), **_JSON_SPELLING,
                            "lenient": not function.get("strict", False)}
    return schema


def _lark_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
