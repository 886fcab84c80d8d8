"""A request's prompts on their way to token ids: size checks that come before any tokenizing, then the
tokenizing itself, which is CPU-heavy and runs on a worker thread (the tokenizer releases the GIL)."""

from __future__ import annotations

import asyncio

from engine.async_engine import EngineInfo
from model.chat_template import reads_content_parts
from model.image_processor import ProcessedImage
from model.tokenizer import Tokenizer
from server import protocol as p
from server.errors import APIError
from server.generation import Prompt, check_length
from server.images import ImageInputs
from server.tool_calls import ToolFormat, prepare_chat
from server.tool_use import ToolUse


def check_prompts(items: list[str | list[int]], max_tokens: int, info: EngineInfo, max_prompts: int,
                  char_limit: int) -> None:
    """Everything about a request's prompts that can be refused before tokenizing: their number, the
    characters of each text, the length and range of each token-id list."""
    if len(items) > max_prompts:
        raise APIError(400, f"{len(items)} prompts in one request; this server takes at most {max_prompts}",
                       param="prompt", code="too_many_prompts")
    for item in items:
        if isinstance(item, str):
            if info.tokenizer is None:
                raise APIError(400, "this model has no tokenizer; send token ids", param="prompt")
            check_chars(len(item), char_limit, "prompt")
        else:
            check_length(len(item), max_tokens, info.max_model_len, "prompt")
            check_token_ids(item, info.vocab_size, "prompt token ids", "prompt")


def check_token_ids(ids: list[int], vocab_size: int, what: str, param: str) -> None:
    """Token ids a request sends are ids of the vocabulary."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise APIError(400, f"{what} must be in [0, {vocab_size}), the vocabulary", param=param)


def check_token_fields(body: p._Request, vocab_size: int) -> None:
    """logit_bias and stop_token_ids name tokens of the vocabulary."""
    for token in body.logit_bias or ():
        if int(token) >= vocab_size:
            raise APIError(400, f"logit_bias names token {token}; the vocabulary has {vocab_size} tokens",
                           param="logit_bias")
    if any(t < 0 or t >= vocab_size for t in body.stop_token_ids or ()):
        raise APIError(400, f"stop_token_ids must be in [0, {vocab_size}), the vocabulary", param="stop_token_ids")


def check_chars(num_chars: int, limit: int, what: str) -> None:
    if num_chars > limit:
        raise APIError(400, f"the {what} has {num_chars} characters; this server tokenizes at most {limit} "
                            "characters per prompt", param=what, code="prompt_too_long")


def to_prompts(items: list[str | list[int]], tokenizer: Tokenizer | None, echo: bool,
               suffix: str | None = None) -> list[Prompt]:
    """Tokenize the texts (and, for echo, detokenize the id lists). CPU-heavy: run it off the event loop.
    A prompt keeps its text only for echo: a request holds what it keeps until it ends. With `suffix`, each
    prompt is the text before an insertion point and becomes a fill-in-the-middle prompt."""
    prompts = []
    for item in items:
        if isinstance(item, str):
            prompt = Prompt(tokenizer.encode(item), item if echo else "")
        else:
            text = tokenizer.decode(item, skip_special_tokens=False) if echo and tokenizer else ""
            prompt = Prompt(list(item), text)
        if suffix is not None:
            prompt = Prompt(tokenizer.encode_fim(prompt.token_ids, suffix), prompt.text)
        prompts.append(prompt)
    return prompts


def chat_tokenizer(info: EngineInfo, body: p.ChatPrompt, char_limit: int) -> Tokenizer:
    """The tokenizer that renders the chat, after the checks that come before rendering it."""
    tokenizer = info.tokenizer
    if tokenizer is None or not tokenizer.chat_template:
        raise APIError(400, "this model has no chat template; use /v1/completions")
    check_chars(sum(len(m.text) for m in body.messages), char_limit, "messages")
    return tokenizer


async def chat_prompt_ids(tokenizer: Tokenizer, body: p.ChatPrompt, fmt: ToolFormat, tools: ToolUse | None,
                          allow_special_tokens: bool, vision: ImageInputs | None = None,
                          ) -> tuple[list[int], list[ProcessedImage]]:
    """The token ids of a chat's prompt, and its images: its messages, the tools it shows the model (`tools`,
    None for none) and its template variables, rendered with the chat template on a worker thread; the
    assistant's turn opened, or the last message left open (`body.opens_turn`, `body.continue_final_message`);
    each image the messages hold read and given its place (server/images.py; `vision` None: the model takes
    none). One function for /v1/chat/completions and /tokenize, so that a count is the count the completion
    sees."""
    urls = [url for m in body.messages for url in m.image_urls]
    if urls and vision is None:
        raise APIError(400, "this model takes no images (image_url content parts)", param="messages")
    parts = vision is not None and reads_content_parts(tokenizer.chat_template)
    messages, template_vars = prepare_chat([m.to_template(parts) for m in body.messages],
                                           tools.definitions if tools is not None else None, fmt)
    template_vars = {**(body.chat_template_kwargs or {}), **template_vars}
    if body.reasoning_effort is not None:
        if "reasoning_effort" not in (tokenizer.chat_template or ""):
            raise APIError(400, "reasoning_effort is read by chat templates that know it (GPT-OSS's); this model's "
                                "does not", param="reasoning_effort")
        template_vars["reasoning_effort"] = body.reasoning_effort
    images = await vision.load(urls) if urls else []
    _, ids = await asyncio.to_thread(render_chat, tokenizer, messages, allow_special_tokens, template_vars,
                                     body.opens_turn, body.continue_final_message)
    if vision is not None:
        ids = vision.place(ids, images, tokenizer)
    return ids, images


def render_chat(tokenizer: Tokenizer, messages: list[dict], allow_special_tokens: bool = False,
                template_vars: dict | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> tuple[str, list[int]]:
    """The chat template's text and its token ids. CPU-heavy: run it off the event loop.

    Special-token text inside the messages (`<|im_end|>` typed by a user) is tokenized as plain text, so a
    message cannot close its own turn and open a system one; the template's own markup stays special.
    `allow_special_tokens` reads it as control tokens instead (the behaviour of encoding the whole text).
    `template_vars`: more variables for the template (`tools`)."""
    template_vars = template_vars or {}
    try:
        if allow_special_tokens:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt, continue_final_message,
                                                 **template_vars)
            return text, tokenizer.encode(text, add_special_tokens=False)
        return tokenizer.encode_chat(messages, add_generation_prompt, continue_final_message, **template_vars)
    except ValueError as error:
        raise APIError(400, f"the chat template rejected the messages: {error}", param="messages") from None
