"""OpenAI-compatible request and response bodies. User input is validated here, where it enters."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

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

from engine.sampling_params import MAX_LOGPROBS, MAX_SPECULATIVE_TOKENS

MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512  # the stream holds back this much text, and scans it for every stop string each token
MAX_MESSAGES = 1024
MAX_CONTENT_PARTS = 1024  # in one message
# In all of a request's messages: each part is a Python object while the body is parsed, so the per-message
# bound alone would let a 4 MiB body of empty parts become 155,000 objects.
MAX_TOTAL_CONTENT_PARTS = 2048
MAX_TOKEN_ID = 2**31 - 1
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_TOOLS = 128
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's bound on one embeddings request
MAX_RERANK_DOCUMENTS = 1000  # Cohere's bound on one rerank request

# Fields of OpenAI's, vLLM's or llama.cpp's APIs that would change the output and that this server does not
# implement: a request naming one is refused (400, naming it) rather than answered as if it were absent.
# Fields not listed that change nothing (`user`, `metadata`, `store`, `cache_prompt`...) are ignored.
UNSUPPORTED_FIELDS = {
    "best_of": "sample n and return them all instead",
    "use_beam_search": "beam search is not implemented",
    "length_penalty": "beam search is not implemented",
    "early_stopping": "beam search is not implemented",
    "allowed_token_ids": "use logit_bias, or a guided_choice or guided_regex",
    "bad_words": "use logit_bias with -100 for their tokens",
    "truncate_prompt_tokens": "prompts are refused when too long, never truncated",
    "include_stop_str_in_output": "stop strings are always left out",
    "spaces_between_special_tokens": "not implemented",
    "guided_whitespace_pattern": "JSON is generated without whitespace",
    "typical_p": "not implemented",
    "top_a": "not implemented",
    "tfs_z": "not implemented",
    "mirostat": "not implemented",
    "mirostat_tau": "not implemented",
    "mirostat_eta": "not implemented",
    "dynatemp_range": "not implemented",
    "dry_multiplier": "not implemented; use repetition_penalty",
    "xtc_probability": "not implemented",
    "repeat_penalty": "this server calls it repetition_penalty",
    "n_predict": "this server calls it max_tokens",
    "n_probs": "use logprobs",
    "samplers": "the sampler order is fixed",
    "functions": "use tools",
    "function_call": "use tool_choice",
    "audio": "audio output is not implemented",
    "modalities": "text is the only output",
    "prediction": "predicted outputs are not implemented",
    "web_search_options": "web search is not implemented",
    "chat_template": "a request cannot bring its own template; the server's is used (ladder serve --chat-template)",
    "documents": "not implemented",
    "logits_processors": "not implemented",
}


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

# The id range is in the schema but checked by the server at the vocabulary size (server/prompts.py): a
# constraint on each element costs more than twice as much to validate, on the event loop, as the list.
TokenId = Annotated[int, Strict(), WithJsonSchema({"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID})]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class StreamOptions(BaseModel):
    include_usage: Annotated[bool, Strict()] = False


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: Annotated[str, Field(min_length=1, max_length=64), CHECK_UNICODE] = "response"
    description: Text | None = None
    # An empty schema (or none) allows any JSON value.
    schema_: Annotated[dict[str, Any] | bool, Field(alias="schema")] = True
    strict: Annotated[bool, Strict()] | None = None  # the schema is always enforced, strict or not


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a json_schema response format needs its json_schema object")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` object: one of its fields."""

    model_config = ConfigDict(extra="forbid")

    json_: Annotated[dict[str, Any] | str | None, Field(alias="json")] = None
    regex: Text | None = None
    choice: Annotated[list[NonEmptyText], Field(min_length=1)] | None = None
    grammar: NonEmptyText | None = None
    json_object: Annotated[bool, Strict()] | None = None


# Chat template variables the server sets itself: a request's chat_template_kwargs may not.
CHAT_TEMPLATE_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token",
                                    "eos_token"})


class _Request(BaseModel):
    # Unknown fields are ignored, as OpenAI's API does, so newer clients keep working; the ones that would
    # change the output and are not implemented are refused by name (UNSUPPORTED_FIELDS).
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
    # vLLM's: each prompt token's log-probability, rank and this many best alternatives (`prompt_logprobs`
    # beside the choices; the first token has none).
    prompt_logprobs: Annotated[int, Strict(), Field(ge=0, le=MAX_LOGPROBS)] | None = None
    user: Text | None = None
    skip_special_tokens: Annotated[bool, Strict()] = True
    # Draft tokens per step speculative decoding by prompt lookup may propose (0: none; absent: the
    # server's --speculative-tokens). Greedy text is the same either way; only the speed changes.
    speculative_tokens: Annotated[int, Strict(), Field(ge=0, le=MAX_SPECULATIVE_TOKENS)] | None = None
    # Token ids as strings (JSON keys), as OpenAI's API has it; ids are checked against the vocabulary.
    logit_bias: Annotated[dict[str, Annotated[float, Strict(), Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    # Structured outputs: OpenAI's response_format, vLLM's guided_* fields and structured_outputs object,
    # llama.cpp's grammar (GBNF) and json_schema. At most one per request (server/guides.py).
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | NonEmptyText | None = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[NonEmptyText], Field(min_length=1)] | None = None
    guided_grammar: NonEmptyText | None = None
    structured_outputs: StructuredOutputs | None = None
    grammar: NonEmptyText | None = None
    json_schema: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, value):
        if isinstance(value, dict):
            for name, why in UNSUPPORTED_FIELDS.items():
                if value.get(name) is not None:
                    raise ValueError(f"{name} is not supported by this server ({why})")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_ids(cls, value):
        for key in value or ():
            if not (key.isascii() and key.isdigit() and int(key) <= MAX_TOKEN_ID):
                raise ValueError(f"logit_bias keys are token ids, got {key[:32]!r}")
        return value

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


def _prompt_shape(value) -> str:
    """Which form of `prompt` a value is, from its type and its first element."""
    if isinstance(value, list) and value:
        first = value[0]
        return "texts" if isinstance(first, str) else "id_lists" if isinstance(first, list) else "ids"
    return "ids" if isinstance(value, list) else "text"  # [] or a non-list: that form's own error says why


def prompts_field(max_items: int | None = None) -> Any:
    """A text, texts, token ids or lists of token ids (at most `max_items` texts or lists). The shape is read
    off the value, so only one form is validated: trying each form in turn would collect an error per
    element of every form that fails, a long stall of the event loop for a large id list."""
    return Annotated[
        Annotated[NonEmptyText, Tag("text")]
        | Annotated[Annotated[list[NonEmptyText], Field(min_length=1, max_length=max_items)], Tag("texts")]
        | Annotated[TokenIds, Tag("ids")]
        | Annotated[Annotated[list[TokenIds], Field(min_length=1, max_length=max_items)], Tag("id_lists")],
        Discriminator(_prompt_shape),
    ]


def one_per_item(value: str | list) -> list[str | list[int]]:
    """A `prompts_field` value as a list, one text or list of token ids per item."""
    return [value] if isinstance(value, str) or isinstance(value[0], int) else list(value)


class CompletionRequest(_Request):
    prompt: prompts_field()
    logprobs: Annotated[int, Strict(), Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: Annotated[bool, Strict()] = False
    # 0 with echo: the prompt alone comes back (scored, with logprobs), as OpenAI's legacy API answers it.
    max_tokens: Annotated[int, Strict(), Field(ge=0)] | None = None
    # Fill in the middle: the text after the insertion point; the prompt is the text before it. For models
    # whose vocabulary has FIM tokens (Qwen2.5-Coder, StarCoder, DeepSeek-Coder, CodeLlama).
    suffix: Text | None = None

    @model_validator(mode="after")
    def _nothing_only_with_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 returns nothing without echo: set echo, or max_tokens of at least 1")
        if self.suffix is not None and self.echo:
            raise ValueError("echo with a suffix is not supported: the prompt is given back without the insertion")
        return self

    @model_validator(mode="before")
    @classmethod
    def _no_chat_fields(cls, value):
        """Tools are a chat feature: sent to /v1/completions they would be ignored, not used."""
        if isinstance(value, dict):
            for name in ("tools", "tool_choice", "messages"):
                if value.get(name) is not None:
                    raise ValueError(f"{name} is not supported on /v1/completions; use /v1/chat/completions")
        return value

    @property
    def prompt_list(self) -> list[str | list[int]]:
        """The prompts, one per item: a text or a list of token ids."""
        return one_per_item(self.prompt)


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ImageURL(BaseModel):
    url: Annotated[str, Field(min_length=1)]  # data:<type>;base64,<data>, or http(s) (server/images.py)
    detail: Literal["auto", "low", "high"] | None = None  # accepted; every image is read at the model's tiles


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL | Annotated[str, Field(min_length=1)]  # the object, or its url alone (vLLM's form)

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(BaseModel):
    name: NonEmptyText
    arguments: Text  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    # None only for an assistant message that made tool calls.
    content: Text | Annotated[list[ContentPart], Field(min_length=1, max_length=MAX_CONTENT_PARTS)] | None = None
    name: Text | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Text | None = None  # a tool message: the call it answers
    # An earlier reply's reasoning, given back: templates that show past reasoning read it (Qwen3's keeps
    # the reasoning of the turns after the last user message).
    reasoning_content: Text | None = None

    @model_validator(mode="after")
    def _content_by_role(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry reasoning_content")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    @property
    def image_urls(self) -> list[str]:
        return [] if isinstance(self.content, str | None) else [p.url for p in self.content if isinstance(p, ImagePart)]

    def to_template(self, parts: bool = False) -> dict:
        """The message as a chat template reads it, `developer` as `system`: its content as plain text, or
        with `parts` (a template that reads content parts: a vision model's) as a list of text parts and
        `{"type": "image"}` parts in their order (an image the template writes as its image token)."""
        content: Any = None if self.content is None else self.text
        if parts and self.content is not None:
            items = [self.content] if isinstance(self.content, str) else self.content
            content = [{"type": "text", "text": item} if isinstance(item, str) else
                       {"type": "text", "text": item.text} if isinstance(item, TextPart) else {"type": "image"}
                       for item in items]
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


class FunctionDefinition(BaseModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: Annotated[bool, Strict()] | None = None  # the arguments always follow the schema when forced


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: NonEmptyText


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatPrompt(BaseModel):
    """The fields that make a chat's prompt: what /v1/chat/completions renders and /tokenize counts."""

    model_config = ConfigDict(extra="ignore")

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    # vLLM's: open the assistant's turn at the end (default: yes, unless the last message continues), or
    # leave the last message (an assistant's) open for the model to continue: a prefilled reply's start.
    add_generation_prompt: Annotated[bool, Strict()] | None = None
    continue_final_message: Annotated[bool, Strict()] = False
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Annotated[bool, Strict()] = True
    # More variables for the chat template (Qwen3's `enable_thinking`, a template's own switches), as vLLM
    # takes them; the ones the server sets itself are refused (CHAT_TEMPLATE_RESERVED).
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's: how hard a reasoning model thinks, for a template that reads it (GPT-OSS's writes it into the
    # system message); refused for a template that does not.
    reasoning_effort: Literal["low", "medium", "high"] | None = None

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
    def _chat_template_kwargs_are_free(self):
        taken = sorted(set(self.chat_template_kwargs or ()) & CHAT_TEMPLATE_RESERVED)
        if taken:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(taken)}: the server sets "
                             f"{', '.join(sorted(CHAT_TEMPLATE_RESERVED))} itself")
        return self

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self):
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools: every function needs its own name")
        if self.tool_choice in ("required",) and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {self.tool_choice.function.name!r}, which is not "
                             "among the tools")
        return self

    @property
    def uses_tools(self) -> bool:
        """Whether the reply may hold tool calls (tools sent, and tool_choice not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def opens_turn(self) -> bool:
        """Whether the prompt ends with the assistant's turn opened (add_generation_prompt)."""
        return not self.continue_final_message if self.add_generation_prompt is None else self.add_generation_prompt

    @model_validator(mode="after")
    def _continue_an_assistant_message(self):
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise ValueError("continue_final_message leaves the last message open: it cannot be combined with "
                                 "add_generation_prompt true")
            if self.messages[-1].role != "assistant" or not self.messages[-1].text.strip():
                raise ValueError("continue_final_message needs a last message from the assistant, with text")
        return self


class ChatCompletionRequest(_Request, ChatPrompt):
    max_completion_tokens: Annotated[int, Strict(), Field(ge=1)] | None = None
    # vLLM's: false leaves a reasoning model's reasoning out of the answer (it is never in `content`).
    include_reasoning: Annotated[bool, Strict()] = True
    # The most tokens a reasoning model's block may hold before its end is written for it (default: the
    # server's --reasoning-budget, else no bound); 0 answers without thinking.
    reasoning_budget: Annotated[int, Strict(), Field(ge=0)] | None = None
    logprobs: Annotated[bool, Strict()] = False
    top_logprobs: Annotated[int, Strict(), Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self


# -- responses -----------------------------------------------------------------------------------


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # A reasoning model's chat completions: how many of the completion's tokens were reasoning.
    completion_tokens_details: CompletionTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str


# vLLM's `prompt_logprobs`: per prompt token, None for the first, else {token id: its entry} for the token
# itself and its best alternatives.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    prompt_logprobs: PromptLogprobs | None = None


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
    reasoning_content: str | None = None  # a reasoning model's thinking (server/reasoning.py)
    tool_calls: list[ToolCall] = []


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # of the templated prompt, as vLLM gives them


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ladder"
    max_model_len: int
    root: str | None = None  # a LoRA adapter: the file or directory it was read from
    parent: str | None = None  # a LoRA adapter: the model it runs on


# A LoRA adapter's name, as requests give it in `model`: no whitespace, and short.
LoRAName = Annotated[str, Strict(), Field(min_length=1, max_length=256, pattern=r"^\S+$")]


class LoadLoRARequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's route and fields)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: LoRAName
    lora_path: Annotated[str, Strict(), Field(min_length=1, max_length=4096)]


class UnloadLoRARequest(BaseModel):
    """POST /v1/unload_lora_adapter."""

    model_config = ConfigDict(extra="forbid")
    lora_name: LoRAName
    lora_int_id: Annotated[int, Strict()] | None = None  # vLLM's; names alone identify adapters here


class ResponsesTool(BaseModel):
    """A Responses API function tool: the chat tool's function fields, flat."""

    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: Annotated[bool, Strict()] | None = None


class ResponsesNamedTool(BaseModel):
    type: Literal["function"]
    name: NonEmptyText


class ResponsesTextFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64), CHECK_UNICODE] = "response"
    description: Text | None = None
    schema_: Annotated[dict[str, Any] | bool, Field(alias="schema")] = True
    strict: Annotated[bool, Strict()] | None = None


class ResponsesText(BaseModel):
    format: ResponsesTextFormat | None = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses (server/responses.py turns it into a chat completion request). Other fields are
    kept for the translation: ladder's sampling fields pass through, the unsupported ones are refused."""

    model_config = ConfigDict(extra="allow")

    model: Text | None = None
    input: NonEmptyText | Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: Text | None = None
    max_output_tokens: Annotated[int, Strict(), Field(ge=1)] | None = None
    temperature: Annotated[float, Strict(), Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Strict(), Field(gt=0.0, le=1.0)] | None = None
    tools: Annotated[list[ResponsesTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedTool | None = None
    parallel_tool_calls: Annotated[bool, Strict()] = True
    text: ResponsesText | None = None
    stream: Annotated[bool, Strict()] = False
    metadata: dict[str, Text] | None = None
    background: Annotated[bool, Strict()] = False
    truncation: Literal["auto", "disabled"] | None = None
    store: Annotated[bool, Strict()] | None = None  # false: not kept for previous_response_id (default: kept)
    previous_response_id: Text | None = None


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings: OpenAI's fields, and vLLM's `add_special_tokens`."""

    model_config = ConfigDict(extra="ignore")
    model: Text | None = None
    input: prompts_field(MAX_EMBEDDING_INPUTS)  # as a completion's prompt
    # base64: each vector's float32 values, little-endian, base64-encoded (the openai client's default).
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Strict(), Field(ge=1)] | None = None  # the first N values, then normalized
    add_special_tokens: Annotated[bool, Strict()] = True  # BOS/EOS where the model's tokenizer adds them
    user: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, value):
        if isinstance(value, dict) and value.get("truncate_prompt_tokens") is not None:
            raise ValueError("truncate_prompt_tokens is not supported by this server (inputs are refused when "
                             "too long, never truncated)")
        return value

    @property
    def input_list(self) -> list[str | list[int]]:
        return one_per_item(self.input)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64 text for encoding_format base64


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="ignore")
    text: Text


class RerankRequest(BaseModel):
    """POST /v1/rerank: Jina's and Cohere's fields (vLLM's too), and Qwen3-Reranker's instruction."""

    model_config = ConfigDict(extra="ignore")
    model: Text | None = None
    query: NonEmptyText
    documents: Annotated[list[Text | RerankDocument], Field(min_length=1, max_length=MAX_RERANK_DOCUMENTS)]
    top_n: Annotated[int, Strict(), Field(ge=1)] | None = None  # the best N only (default: all)
    return_documents: Annotated[bool, Strict()] = True
    # What relevance means here (Qwen3-Reranker's <Instruct>); default: a web search query's passages.
    instruction: NonEmptyText | None = None

    @property
    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class RerankResult(BaseModel):
    index: int
    relevance_score: float  # the probability that the document meets the query, in [0, 1]
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]  # best first


class ScoreRequest(BaseModel):
    """POST /v1/score (vLLM's): `text_1` (the query) against each `text_2`, or two lists of one length scored
    pairwise."""

    model_config = ConfigDict(extra="ignore")
    model: Text | None = None
    text_1: NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_RERANK_DOCUMENTS)]
    text_2: Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_RERANK_DOCUMENTS)]
    instruction: NonEmptyText | None = None  # as /v1/rerank's

    @model_validator(mode="after")
    def _pairs_line_up(self):
        if isinstance(self.text_1, list) and isinstance(self.text_2, list) and len(self.text_1) != len(self.text_2):
            raise ValueError(f"text_1 has {len(self.text_1)} texts and text_2 {len(self.text_2)}: lists are scored "
                             "pairwise, so their lengths must be equal (or text_1 one text)")
        if isinstance(self.text_1, list) and isinstance(self.text_2, str):
            raise ValueError("text_1 is a list and text_2 one text: give text_2 a text per text_1, or swap them")
        return self

    @property
    def pairs(self) -> list[tuple[str, str]]:
        seconds = self.text_2 if isinstance(self.text_2, list) else [self.text_2]
        firsts = self.text_1 if isinstance(self.text_1, list) else [self.text_1] * len(seconds)
        return list(zip(firsts, seconds))


class Score(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[Score]
    usage: RerankUsage


class TokenizeText(BaseModel):
    """POST /tokenize with a text: vLLM's `prompt` and `add_special_tokens` (default true), or llama.cpp's
    `content` and `add_special` (default false)."""

    model_config = ConfigDict(extra="ignore")
    model: Text | None = None
    prompt: Text | None = None
    content: Text | None = None
    add_special_tokens: Annotated[bool, Strict()] | None = None
    add_special: Annotated[bool, Strict()] | None = None
    return_token_strs: Annotated[bool, Strict()] = False  # vLLM's: each token's vocabulary spelling
    with_pieces: Annotated[bool, Strict()] = False  # llama.cpp's: tokens as {id, piece}

    @model_validator(mode="after")
    def _one_text(self):
        if (self.prompt is None) == (self.content is None):
            raise ValueError("give the text to tokenize as prompt (or llama.cpp's content), or give messages")
        return self

    @property
    def text(self) -> str:
        return self.prompt if self.prompt is not None else self.content

    @property
    def adds_special_tokens(self) -> bool:
        """BOS (and EOS) where the model asks for them: vLLM's default for `prompt`, not llama.cpp's."""
        for given in (self.add_special_tokens, self.add_special):
            if given is not None:
                return given
        return self.prompt is not None


class TokenizeChat(ChatPrompt):
    """POST /tokenize with vLLM's chat form: the ids a chat completion with these fields would be given."""

    model: Text | None = None
    return_token_strs: Annotated[bool, Strict()] = False
    with_pieces: Annotated[bool, Strict()] = False

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, value):
        if isinstance(value, dict):
            if value.get("prompt") is not None or value.get("content") is not None:
                raise ValueError("give either messages or a text (prompt or content), not both")
            if value.get("add_special_tokens"):
                raise ValueError("add_special_tokens: a chat's special tokens are the template's own")
            if value.get("chat_template"):
                why = UNSUPPORTED_FIELDS["chat_template"]
                raise ValueError(f"chat_template is not supported by this server ({why})")
        return value


# The form is chosen by the body's keys: messages make it a chat.
TokenizeRequest = Annotated[
    Annotated[TokenizeChat, Tag("chat")] | Annotated[TokenizeText, Tag("text")],
    Discriminator(lambda value: "chat" if isinstance(value, dict) and "messages" in value else "text"),
]


class TokenPiece(BaseModel):
    id: int
    piece: str | list[int]  # the token's text, or its bytes when they are not whole UTF-8 characters


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int] | list[TokenPiece]  # ids; {id, piece} when with_pieces was asked for
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's and llama.cpp's): token ids back to text, special tokens kept."""

    model_config = ConfigDict(extra="ignore")
    model: Text | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str  # vLLM's name
    content: str  # llama.cpp's name for the same text


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
