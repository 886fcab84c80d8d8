"""POST /v1/embeddings: OpenAI's embeddings endpoint over the same engine that generates.

Each input runs as an embedding request (engine/llm_engine.py): its prompt is computed in the continuous
batch beside the generating requests, nothing is sampled, and its final hidden states are pooled by the
engine's rule (model/pooling.py: the checkpoint's, or the last token's). A request of many inputs keeps at
most EMBEDDING_WINDOW of them in the engine at once and holds that many sequences of the admission queue,
so a batch of 2,048 texts neither floods the scheduler nor waits for room it could never get.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI, Request

from engine.async_engine import AsyncLLMEngine, EngineDeadError
from model.pooling import finish_embedding
from server import protocol as p
from server.errors import APIError
from server.generation import request_error
from server.prompts import check_chars, check_token_ids

if TYPE_CHECKING:
    from server.app import ServerState

ERRORS = {status: {"model": p.ErrorResponse} for status in (400, 401, 404, 413, 429, 500, 503)}
EMBEDDING_WINDOW = 32  # inputs of one request in the engine at once


def install_embedding_routes(app: FastAPI, state: ServerState, authorize,
                             admit: Callable[[p.EmbeddingRequest], tuple[AsyncLLMEngine, str | None]],
                             until_disconnected: Callable[[Request, Awaitable], Awaitable]) -> None:
    """`admit`: the engine for a request's `model` (404 else); `until_disconnected`: awaits work, cancelling
    it when the client goes away."""

    @app.post("/v1/embeddings", response_model=p.EmbeddingResponse, responses=ERRORS,
              dependencies=[Depends(authorize)])
    async def embeddings(body: p.EmbeddingRequest, request: Request) -> p.EmbeddingResponse:
        engine, lora = admit(body)
        info = engine.info
        if info.embeddings_unavailable is not None:
            raise APIError(400, info.embeddings_unavailable)
        hidden = info.model_config.hidden_size
        if body.dimensions is not None and body.dimensions > hidden:
            raise APIError(400, f"dimensions is {body.dimensions}; this model's embeddings have {hidden}",
                           param="dimensions")
        items = body.input_list
        check_inputs(items, info.tokenizer is not None, info.vocab_size, info.max_model_len,
                     state.settings.prompt_char_limit(info.max_model_len))
        window = min(len(items), EMBEDDING_WINDOW)
        reservation = state.admission.reserve(window)
        try:
            ids = await asyncio.to_thread(tokenize, items, info.tokenizer, body.add_special_tokens)
            for i, prompt in enumerate(ids):
                if len(prompt) > info.max_model_len:
                    raise APIError(400, f"input {i} has {len(prompt)} tokens; this model takes at most "
                                        f"{info.max_model_len}", param="input", code="context_length_exceeded")
            vectors = await until_disconnected(request, embed_all(engine, ids, lora, window))
        except EngineDeadError:
            raise APIError(503, "the engine has stopped after an internal error") from None
        finally:
            reservation.release()
        pooling = info.pooling
        data = [p.Embedding(index=i, embedding=encode(finish_embedding(v, pooling.normalize, body.dimensions),
                                                      body.encoding_format))
                for i, v in enumerate(vectors)]
        num_tokens = sum(len(prompt) for prompt in ids)
        return p.EmbeddingResponse(data=data, model=body.model or state.model_name,
                                   usage=p.EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))


def check_inputs(items: list[str | list[int]], has_tokenizer: bool, vocab_size: int, max_model_len: int,
                 char_limit: int) -> None:
    """Everything about the inputs that can be refused before tokenizing."""
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not has_tokenizer:
                raise APIError(400, "this model has no tokenizer; send token ids", param="input")
            check_chars(len(item), char_limit, "input")
        else:
            if len(item) > max_model_len:
                raise APIError(400, f"input {i} has {len(item)} tokens; this model takes at most {max_model_len}",
                               param="input", code="context_length_exceeded")
            check_token_ids(item, vocab_size, "input token ids", "input")


def tokenize(items: list[str | list[int]], tokenizer, add_special_tokens: bool) -> list[list[int]]:
    """Token ids of every input, the texts in one call (CPU-heavy: off the event loop)."""
    texts = [item for item in items if isinstance(item, str)]
    encoded = iter(tokenizer.encode_all(texts, add_special_tokens) if texts else ())
    return [next(encoded) if isinstance(item, str) else list(item) for item in items]


async def embed_all(engine: AsyncLLMEngine, ids: list[list[int]], lora: str | None, window: int,
                    score_token_ids: tuple[int, ...] = ()) -> list:
    """The pooled vectors of every input, in order, at most `window` in the engine at once (with
    `score_token_ids`, the next-token logits of those tokens after each input instead). The first failure
    ends the others (their engine requests are aborted) and becomes the response's error."""
    gate = asyncio.Semaphore(window)

    async def one(prompt: list[int]):
        async with gate:
            delta = await engine.embed(prompt, lora=lora, score_token_ids=score_token_ids)
        if delta.embedding is None:
            raise request_error(delta)
        return delta.embedding

    tasks = [asyncio.ensure_future(one(prompt)) for prompt in ids]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def encode(vector, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # float32 little-endian, as OpenAI's API and its clients read it
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
