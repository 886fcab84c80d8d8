"""The FastAPI application: OpenAI-compatible endpoints over the async engine.

The app starts answering before the model is loaded (`/ready` is 503 until it is), refuses work while
draining for shutdown, and turns every failure into an OpenAI-shaped error.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from engine.async_engine import AsyncLLMEngine
from engine.outputs import SampleDelta
from server import protocol as p
from server.admission import Admission, Reservation
from server.dashboard import install_dashboard
from server.errors import APIError, error_response, install_error_handlers
from server.prompts import check_chars, check_prompts, render_chat, to_prompts
from server.generation import (Collected, Job, Prompt, chat_response, check_length, collect,
                               completion_response, new_id, sampling_params, stream_events)
from server.metrics import ServerMetrics

# Text longer than this many characters per token of context is refused before it is tokenized: real
# tokenizers average 3 to 5 characters a token, and tokenizing megabytes costs seconds of CPU.
CHARS_PER_TOKEN_BOUND = 32
ERRORS = {status: {"model": p.ErrorResponse} for status in (400, 401, 404, 413, 429, 500, 503)}
# With "stream": true the 200 response is server-sent events.
STREAMING = {**ERRORS, 200: {"content": {"text/event-stream": {"schema": {
    "description": "chunks of the response object, an error object, then the string [DONE]",
    "anyOf": [{"type": "object"}, {"type": "string", "enum": ["[DONE]"]}]}}}}}


@dataclass
class ServerSettings:
    served_model_name: str | None = None  # default: the model's own name
    api_key: str | None = None
    max_queue: int = 256  # sequences (prompts x n of every request) in flight beyond which requests get 429
    max_body_bytes: int = 4 << 20
    max_prompts_per_request: int = 64
    max_prompt_chars: int | None = None  # default: CHARS_PER_TOKEN_BOUND x max_model_len
    stream_interval: int = 1  # tokens per streamed event (a sample's first and last go at once)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        for name in ("max_queue", "max_body_bytes", "max_prompts_per_request", "stream_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be at least 1, got {self.max_prompt_chars}")

    def prompt_char_limit(self, max_model_len: int) -> int:
        return self.max_prompt_chars or CHARS_PER_TOKEN_BOUND * max_model_len


class ServerState:
    """What the routes need; the engine arrives when loading finishes."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.engine: AsyncLLMEngine | None = None
        self.load_error: str | None = None
        self.draining = False
        self.admission = Admission(settings.max_queue)
        self.metrics = ServerMetrics(self._stats, lambda: self.engine is not None and self.engine.is_alive)

    def _stats(self):
        return self.engine.stats if self.engine else None

    def attach(self, engine: AsyncLLMEngine) -> None:
        engine.stats.observers.append(self.metrics.observe_finished)
        self.engine = engine

    @property
    def model_name(self) -> str:
        return self.settings.served_model_name or (self.engine.info.model_name if self.engine else "")

    def ready_engine(self) -> AsyncLLMEngine:
        if self.draining:
            raise APIError(503, "the server is shutting down")
        if self.engine is None:
            raise APIError(503, self.load_error or "the model is still loading")
        if not self.engine.is_alive:
            raise APIError(503, "the engine has stopped after an internal error")
        return self.engine


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="ladder", version="0.1.0",
                  description="OpenAI-compatible completions and chat completions over ladder's engine.")
    app.state.ladder = state
    install_error_handlers(app)
    install_dashboard(app, state)

    app.add_middleware(BodyLimit, limit=state.settings.max_body_bytes)

    def authorize(request: Request) -> None:
        key = state.settings.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), key.encode()):
            raise APIError(401, "missing or invalid API key", code="invalid_api_key")

    def admit(body: p._Request) -> AsyncLLMEngine:
        engine = state.ready_engine()
        if body.model is not None and body.model != state.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {state.model_name!r}",
                           param="model", code="model_not_found")
        return engine

    async def respond(engine: AsyncLLMEngine, job: Job, body: p._Request, request: Request, chat: bool,
                      build: Callable[[Collected], BaseModel], reservation: Reservation):
        """Stream the job as server-sent events, or collect it and `build` the response body (on a worker
        thread: logprobs detokenize every token). The reservation ends with the job's sequences."""
        on_delta = itl_observer(state)
        if body.stream:
            events = held(stream_events(engine, job, engine.info.tokenizer, chat=chat,
                                        echo=getattr(body, "echo", False), include_usage=body.include_usage,
                                        on_delta=on_delta, interval=state.settings.stream_interval), reservation)
            reservation.release_with(events)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            result = await until_disconnected(request, collect(engine, job, on_delta))
        finally:
            reservation.release()
        return await asyncio.to_thread(build, result)

    @app.get("/health", responses=ERRORS)
    async def health() -> JSONResponse:
        if state.engine is not None and not state.engine.is_alive:
            return error_response(503, "the engine has stopped after an internal error")
        return JSONResponse({"status": "ok"})

    @app.get("/ready", responses=ERRORS)
    async def ready() -> JSONResponse:
        state.ready_engine()
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", response_model=p.ModelList, responses=ERRORS, dependencies=[Depends(authorize)])
    async def models() -> p.ModelList:
        engine = state.ready_engine()
        card = p.ModelCard(id=state.model_name, created=state.settings.created,
                           max_model_len=engine.info.max_model_len)
        return p.ModelList(data=[card])

    @app.post("/v1/completions", response_model=p.CompletionResponse, responses=STREAMING,
              dependencies=[Depends(authorize)])
    async def completions(body: p.CompletionRequest, request: Request):
        engine = admit(body)
        info = engine.info
        tokenizer = info.tokenizer
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        items = body.prompt_list
        settings = state.settings
        # Sizes first, before anything is tokenized.
        check_prompts(items, max_tokens, info, settings.max_prompts_per_request,
                      settings.prompt_char_limit(info.max_model_len))
        reservation = state.admission.reserve(len(items) * body.n)
        try:
            prompts = await asyncio.to_thread(to_prompts, items, tokenizer, body.echo)
            for prompt in prompts:
                check_length(len(prompt.token_ids), max_tokens, info.max_model_len, "prompt")
            job = Job(new_id("cmpl"), prompts, sampling_params(body, max_tokens, body.logprobs), state.model_name,
                      body.logprobs)
            return await respond(engine, job, body, request, chat=False, reservation=reservation,
                                 build=lambda result: completion_response(job, result, tokenizer, body.echo))
        except BaseException:
            reservation.release()
            raise

    @app.post("/v1/chat/completions", response_model=p.ChatCompletionResponse, responses=STREAMING,
              dependencies=[Depends(authorize)])
    async def chat_completions(body: p.ChatCompletionRequest, request: Request):
        engine = admit(body)
        info = engine.info
        tokenizer = info.tokenizer
        if tokenizer is None or not tokenizer.chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions")
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text} for m in body.messages]
        check_chars(sum(len(m["content"]) for m in messages), state.settings.prompt_char_limit(info.max_model_len),
                    "messages")
        reservation = state.admission.reserve(body.n)
        try:
            text, ids = await asyncio.to_thread(render_chat, tokenizer, messages)
            requested = body.max_completion_tokens or body.max_tokens
            max_tokens = requested if requested is not None else max(info.max_model_len - len(ids), 1)
            check_length(len(ids), max_tokens, info.max_model_len, "messages")
            num_top = (body.top_logprobs or 0) if body.logprobs else None
            job = Job(new_id("chatcmpl"), [Prompt(ids, text)], sampling_params(body, max_tokens, num_top),
                      state.model_name, num_top)
            return await respond(engine, job, body, request, chat=True, reservation=reservation,
                                 build=lambda result: chat_response(job, result, tokenizer))
        except BaseException:
            reservation.release()
            raise

    return app


class BodyLimit:
    """Pure ASGI middleware: 413 for a body over `limit` bytes, declared or streamed."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        too_large = APIError(413, f"request body larger than {self.limit} bytes")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            response = error_response(413, too_large.message)
            return await response(scope, receive, send)
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise too_large  # handled by the app's APIError handler: it runs inside the route
            return message

        await self.app(scope, counted_receive, send)


async def held(events: AsyncIterator[str], reservation: Reservation) -> AsyncIterator[str]:
    """The stream's events; its reservation ends when the stream does (finished, failed or abandoned)."""
    try:
        async with aclosing(events):
            async for event in events:
                yield event
    finally:
        reservation.release()


def itl_observer(state: ServerState) -> Callable[[SampleDelta], None]:
    """Observes the gap between consecutive outputs of each sample."""
    last: dict[tuple[str, int], float] = {}

    def observe(delta: SampleDelta) -> None:
        key = (delta.request_id, delta.index)
        now = time.monotonic()
        if key in last and delta.token_ids:
            state.metrics.itl.observe(now - last[key])
        last[key] = now

    return observe


async def until_disconnected(request: Request, work: Awaitable):
    """Await `work`, cancelling it (which aborts its engine requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected")
    finally:
        if not task.done():
            task.cancel()
