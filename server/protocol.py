"""OpenAI-compatible request and response bodies. User input is validated here, where it enters."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Strict,
    Tag,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from engine.sampling_params import MAX_LOGPROBS

MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512  # the stream holds back this much text, and scans it for every stop string each token
MAX_MESSAGES = 1024
MAX_CONTENT_PARTS = 1024  # in one message
# In all of a request's messages: each part is a Python object while the body is parsed, so the per-message
# bound alone would let a 4 MiB body of empty parts become 155,000 objects.
MAX_TOTAL_CONTENT_PARTS = 2048
MAX_TOKEN_ID = 2**31 - 1


def _valid_unicode(value: object) -> object:
    """Refuses a string holding a lone surrogate (JSON's `"\\ud800"` escape decodes to one): it has no
    UTF-8 form, so tokenizing it, logging it or echoing it back would fail. ASCII, the usual case, is
    known valid at once; other text is encoded once, which is faster than scanning it for surrogates."""
    if isinstance(value, str) and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(f"contains a lone surrogate (U+{ord(value[error.start]):04X}) at character "
                             f"{error.start}; text must be valid Unicode") from None
    return value


# Every string of a request is checked first, before pydantic's own checks, which refuse such a string with a
# less helpful message when the field has a length bound and pass it on when it has none. The bounds go
# before the check (a bound after it would lose its string-specific message).
CHECK_UNICODE = BeforeValidator(_valid_unicode)
Text = Annotated[str, CHECK_UNICODE]
NonEmptyText = Annotated[str, Field(min_length=1), CHECK_UNICODE]
StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS), CHECK_UNICODE]

# Numbers and booleans are strict: lax validation would read `"top_p": true` as 1.0 and `"n": 2.0` as 2,
# accepting what the schema says is invalid.


class StreamOptions(BaseModel):
    include_usage: Annotated[bool, Strict()] = False


class _Request(BaseModel):
    # Unknown fields are ignored, as OpenAI's API does, so newer clients keep working.
    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    max_tokens: Annotated[int, Strict(), Field(ge=1)] | None = None
    temperature: Annotated[float, Strict(), Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Strict(), Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Strict(), Field(ge=-1)] | None = None
    min_p: Annotated[float, Strict(), Field(ge=0.0, le=1.0)] | None = None
    n: Annotated[int, Strict(), Field(ge=1, le=MAX_N)] = 1
    stop: StopText | Annotated[
        list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS), CHECK_UNICODE]],
        Field(max_length=MAX_STOP_STRINGS)
    ] | None = None
    seed: Annotated[int, Strict(), Field(ge=-(2**63), le=2**63 - 1)] | None = None
    presence_penalty: Annotated[float, Strict(), Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Strict(), Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Strict(), Field(gt=0.0, le=2.0)] | None = None
    stream: Annotated[bool, Strict()] = False
    stream_options: StreamOptions | None = None
    ignore_eos: Annotated[bool, Strict()] = False
    min_tokens: Annotated[int, Strict(), Field(ge=0)] = 0
    user: Text | None = None

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value):
        if isinstance(value, str) and not value:
            raise ValueError("stop must not be an empty string")
        return value

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# The id range is in the schema but checked by the server at the vocabulary size (server/prompts.py): a
# constraint on each element costs more than twice as much to validate, on the event loop, as the list.
TokenId = Annotated[int, Strict(), WithJsonSchema({"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID})]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


def _prompt_shape(value) -> str:
    """Which form of `prompt` a value is, from its type and its first element."""
    if isinstance(value, list) and value:
        first = value[0]
        return "texts" if isinstance(first, str) else "id_lists" if isinstance(first, list) else "ids"
    return "ids" if isinstance(value, list) else "text"  # [] or a non-list: that form's own error says why


class CompletionRequest(_Request):
    # The shape is read off the value, so only one form is validated: trying each form in turn would collect
    # an error per element of every form that fails, a long stall of the event loop for a large id list.
    prompt: Annotated[
        Annotated[NonEmptyText, Tag("text")]
        | Annotated[Annotated[list[NonEmptyText], Field(min_length=1)], Tag("texts")]
        | Annotated[TokenIds, Tag("ids")]
        | Annotated[Annotated[list[TokenIds], Field(min_length=1)], Tag("id_lists")],
        Discriminator(_prompt_shape),
    ]
    logprobs: Annotated[int, Strict(), Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: Annotated[bool, Strict()] = False

    @model_validator(mode="after")
    def _echo_without_logprobs(self):
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported (prompt log-probabilities are not computed)")
        return self

    @property
    def prompt_list(self) -> list[str | list[int]]:
        """The prompts, one per item: a text or a list of token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: Text | Annotated[list[TextPart], Field(min_length=1, max_length=MAX_CONTENT_PARTS)]
    name: Text | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[int, Strict(), Field(ge=1)] | None = None
    logprobs: Annotated[bool, Strict()] = False
    top_logprobs: Annotated[int, Strict(), Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _bound_content_parts(cls, value):
        """Counts the parts on the parsed JSON, before any is built as an object. Past MAX_MESSAGES the
        list's own bound refuses it."""
        if isinstance(value, list) and len(value) <= MAX_MESSAGES:
            num_parts = sum(len(m["content"]) for m in value
                            if isinstance(m, dict) and isinstance(m.get("content"), list))
            if num_parts > MAX_TOTAL_CONTENT_PARTS:
                raise ValueError(f"{num_parts} content parts in all; this server takes at most "
                                 f"{MAX_TOTAL_CONTENT_PARTS} per request")
        return value

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self


# -- responses -----------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ladder"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
