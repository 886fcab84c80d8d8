"""Text <-> token ids over HTTP: POST /tokenize and /detokenize, in vLLM's shape and llama.cpp's.

Clients count a prompt's tokens before sending it, check what a chat template makes of their messages, and
turn ids from logprobs back into text. A chat is rendered by the function /v1/chat/completions uses
(server/prompts.py), tools and template variables included, so its count is the count the completion sees.
Nothing here runs the model: the engine is only asked for its tokenizer, and the work runs off the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI

from engine.async_engine import AsyncLLMEngine
from model.tokenizer import Tokenizer
from server import protocol as p
from server.errors import APIError
from server.prompts import chat_prompt_ids, chat_tokenizer, check_chars, check_token_ids
from server.tool_calls import tool_format
from server.tool_use import ToolUse

if TYPE_CHECKING:
    from server.app import ServerState

ERRORS = {status: {"model": p.ErrorResponse} for status in (400, 401, 404, 413, 503)}


def install_token_routes(app: FastAPI, state: ServerState, authorize,
                         admit: Callable[[p.DetokenizeRequest | p.TokenizeText | p.TokenizeChat],
                                         tuple[AsyncLLMEngine, str | None]]) -> None:
    """`admit`: the engine for a request's `model` (the served model or one of its adapters; 404 else)."""

    @app.post("/tokenize", response_model=p.TokenizeResponse, response_model_exclude_none=True, responses=ERRORS,
              dependencies=[Depends(authorize)])
    async def tokenize(body: p.TokenizeRequest) -> p.TokenizeResponse:
        engine, _ = admit(body)
        info = engine.info
        char_limit = state.settings.prompt_char_limit(info.max_model_len)
        if isinstance(body, p.TokenizeChat):
            tokenizer = chat_tokenizer(info, body, char_limit)
            fmt = tool_format(tokenizer.chat_template)
            ids, _ = await chat_prompt_ids(tokenizer, body, fmt, ToolUse.of(body, fmt),
                                           state.settings.allow_special_tokens_in_content, state.vision)
        else:
            tokenizer = needs_tokenizer(info.tokenizer)
            check_chars(len(body.text), char_limit, "prompt")
            ids = await asyncio.to_thread(tokenizer.encode, body.text, body.adds_special_tokens)
        tokens = [p.TokenPiece(id=i, piece=piece(tokenizer, i)) for i in ids] if body.with_pieces else ids
        strs = [tokenizer.id_to_token(i) or "" for i in ids] if body.return_token_strs else None
        return p.TokenizeResponse(count=len(ids), max_model_len=info.max_model_len, tokens=tokens, token_strs=strs)

    @app.post("/detokenize", response_model=p.DetokenizeResponse, responses=ERRORS, dependencies=[Depends(authorize)])
    async def detokenize(body: p.DetokenizeRequest) -> p.DetokenizeResponse:
        engine, _ = admit(body)
        tokenizer = needs_tokenizer(engine.info.tokenizer)
        check_token_ids(body.tokens, engine.info.vocab_size, "token ids", "tokens")
        text = await asyncio.to_thread(tokenizer.decode, body.tokens, False)
        return p.DetokenizeResponse(prompt=text, content=text)


def needs_tokenizer(tokenizer: Tokenizer | None) -> Tokenizer:
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer")
    return tokenizer


def piece(tokenizer: Tokenizer, token_id: int) -> str | list[int]:
    """llama.cpp's piece: the token's text, or its bytes when they are not whole UTF-8 characters."""
    data = tokenizer.token_bytes(token_id)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)
