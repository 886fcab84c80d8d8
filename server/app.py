"""The FastAPI application: OpenAI-compatible endpoints over the async engine.

The app starts answering before the model is loaded (`/ready` is 503 until it is), refuses work while
draining for shutdown, and turns every failure into an OpenAI-shaped error. A route validates and prepares
its job, then returns at once: the generation runs while the response is sent, so the parsed request body
is not held through it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.types import Receive, Scope, Send

from engine.async_engine import AsyncLLMEngine
from engine.outputs import SampleDelta
from engine.sampling_params import ThinkBlock
from server import protocol as p
from server.access import INVALID_KEY, KeyGate, bearer_matches, check_key
from server.admission import Admission, Reservation
from server.dashboard import install_dashboard
from server.embeddings import install_embedding_routes
from server.errors import APIError, error_response, install_error_handlers
from server.generation import (
    Collected,
    Job,
    Prompt,
    chat_response,
    check_length,
    collect,
    completion_response,
    new_id,
    sampling_params,
    stream_events,
)
from server.guides import compile_guide, request_guide
from server.harmony import HARMONY_REPLY, HarmonyFormat, HarmonyReasoning
from server.images import ImageInputs
from server.lora_routes import install_lora_routes
from server.metrics import ServerMetrics
from server.middleware import BodyLimit, InFlight
from server.prompts import chat_prompt_ids, chat_tokenizer, check_prompts, check_token_fields, to_prompts
from server.reasoning import ALIASES as REASONING_ALIASES
from server.reasoning import Reasoning, ReasoningFormat
from server.rerank import Reranker, install_rerank_routes
from server.response_store import ResponseStore, output_messages
from server.responses import ResponseEvents, chat_body, new_item_id
from server.token_routes import install_token_routes
from server.tool_calls import tool_format
from server.tool_use import ToolUse

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
    max_body_bytes: int = 20 << 20  # a chat's images come base64 in the body
    max_prompts_per_request: int = 64
    max_prompt_chars: int | None = None  # default: CHARS_PER_TOKEN_BOUND x max_model_len
    stream_interval: int = 1  # tokens per streamed event (a sample's first and last go at once)
    # /metrics and /stats (the page's panels) need the API key too. They show exact prefix-cache hit counts,
    # which tell a watcher whether a prompt was seen before. Default (None): when there is an API key, since
    # a server that has one is not meant to be open; False keeps them open for scrapers that send no token.
    protect_metrics: bool | None = None
    # Special-token text in chat messages becomes control tokens (the template's markup) instead of text.
    allow_special_tokens_in_content: bool = False
    # A reasoning model's <think> block goes to `reasoning_content` (server/reasoning.py): auto (when the
    # vocabulary has the markers), none, or think (required).
    reasoning_parser: str = "auto"
    # Serve /v1/rerank (server/rerank.py): auto (a model named a reranker), on, off.
    reranker: str = "auto"
    # The default reasoning budget of chat requests (tokens in a reasoning block; None: no bound).
    reasoning_budget: int | None = None
    # A vision model's images: at most this many in one request, and fetched from these hosts only (http(s)
    # URLs; `*` any host, `*.example.com` its subdomains); data: URLs are always read.
    max_images_per_prompt: int = 8
    allowed_image_domains: tuple[str, ...] = ()
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        for name in ("max_queue", "max_body_bytes", "max_prompts_per_request", "stream_interval",
                     "max_images_per_prompt"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.reasoning_budget is not None and self.reasoning_budget < 0:
            raise ValueError(f"reasoning_budget must be at least 0, got {self.reasoning_budget}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be at least 1, got {self.max_prompt_chars}")
        check_key(self.api_key)
        if self.protect_metrics and self.api_key is None:
            raise ValueError("protect_metrics needs an api_key: without one there is no key to ask for")

    @property
    def metrics_need_key(self) -> bool:
        return self.api_key is not None and self.protect_metrics is not False

    def prompt_char_limit(self, max_model_len: int) -> int:
        return self.max_prompt_chars or CHARS_PER_TOKEN_BOUND * max_model_len


class ServerState:
    """What the routes need; the engine arrives when loading finishes."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.engine: AsyncLLMEngine | None = None
        self.load_error: str | None = None
        self.draining = False
        self.num_requests = 0  # HTTP requests in flight (server/middleware.py InFlight), for the drain
        self.admission = Admission(settings.max_queue)
        self.responses = ResponseStore()  # the Responses API's stored responses (previous_response_id)
        self.metrics = ServerMetrics(self._stats, lambda: self.engine is not None and self.engine.is_alive)
        self.reasoning: ReasoningFormat | None = None  # the served model's, found when it is attached
        self.harmony: HarmonyFormat | None = None  # likewise: a model that writes harmony's messages (GPT-OSS)
        self.reranker: Reranker | None = None  # likewise
        self.vision: ImageInputs | None = None  # how chats' images are read, for a model that takes them

    def _stats(self):
        return self.engine.stats if self.engine else None

    def attach(self, engine: AsyncLLMEngine) -> None:
        """Serve `engine`. Raises ValueError for a --reasoning-parser its model cannot use."""
        tokenizer = engine.info.tokenizer
        self.harmony = HarmonyFormat.find(tokenizer) if tokenizer is not None else None
        parser = REASONING_ALIASES.get(self.settings.reasoning_parser, self.settings.reasoning_parser)
        if parser == "harmony" and self.harmony is None:
            raise ValueError(f"--reasoning-parser {self.settings.reasoning_parser} reads harmony's analysis channel; "
                             "this model's vocabulary has no harmony markers (<|channel|>, <|message|>)")
        if parser == "think" and self.harmony is not None:
            raise ValueError(f"--reasoning-parser {self.settings.reasoning_parser} reads <think> blocks; this model "
                             "writes harmony's channels (use auto or openai_gptoss)")
        self.reasoning = ReasoningFormat.for_server(self.settings.reasoning_parser, tokenizer) \
            if tokenizer is not None and self.harmony is None and parser != "harmony" else None
        self.reranker = Reranker.find(self.settings.reranker, engine.info.model_name, tokenizer,
                                      engine.info.reranker_file)
        info = engine.info
        self.vision = None if info.image_processor is None else ImageInputs(
            info.image_processor, self.settings.allowed_image_domains,
            self.settings.max_images_per_prompt)
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

    # The last added is the outermost: every request is counted, the refused ones too; the key is checked
    # before the body is read.
    app.add_middleware(BodyLimit, limit=state.settings.max_body_bytes)
    app.add_middleware(KeyGate, settings=state.settings)
    app.add_middleware(InFlight, state=state)

    # Async, so FastAPI calls them on the event loop: a sync dependency is a worker-thread hop, during which
    # other requests get parsed, so that many parsed bodies would be alive at once.
    key = check_key(state.settings.api_key)

    async def authorize(request: Request) -> None:
        """The routes' own key check, behind KeyGate's (which refuses before the body is read): a route
        that needs the key keeps needing it whatever the gate's lists say."""
        if key is not None and not bearer_matches(request.headers.get("authorization", ""), key):
            raise APIError(401, INVALID_KEY, code="invalid_api_key")

    async def authorize_metrics(request: Request) -> None:
        if state.settings.metrics_need_key:
            await authorize(request)

    install_dashboard(app, state, authorize_metrics)
    install_lora_routes(app, state, authorize)

    def admit(body: p._Request | p.EmbeddingRequest | p.RerankRequest | p.TokenizeText | p.TokenizeChat
              | p.DetokenizeRequest) -> tuple[AsyncLLMEngine, str | None]:
        """The engine, and the LoRA adapter the request's `model` names (None: the base model)."""
        engine = state.ready_engine()
        if body.model is None or body.model == state.model_name:
            return engine, None
        if body.model in engine.loras:
            return engine, body.model
        served = ", ".join(repr(name) for name in (state.model_name, *engine.loras))
        raise APIError(404, f"the model {body.model!r} does not exist; this server serves {served}",
                       param="model", code="model_not_found")

    install_token_routes(app, state, authorize, admit)
    install_embedding_routes(app, state, authorize, admit, until_disconnected)
    install_rerank_routes(app, state, authorize, admit, until_disconnected)

    def respond(engine: AsyncLLMEngine, job: Job, reply: Reply, request: Request, chat: bool,
                build: Callable[[Collected], BaseModel], reservation: Reservation) -> Response:
        """A response that runs the job as it is sent: server-sent events, or the collected job's body from
        `build` (on a worker thread: logprobs detokenize every token). The reservation ends with the job's
        sequences, or when the response is dropped unsent."""
        forget_body(request)
        on_delta = itl_observer(state)
        if reply.stream:
            chunks = stream_events(engine, job, engine.info.tokenizer, chat=chat, echo=reply.echo,
                                   include_usage=reply.include_usage, on_delta=on_delta,
                                   interval=state.settings.stream_interval, tools=reply.tools,
                                   reasoning=reply.reasoning)
            events = held(reply.translate(chunks) if reply.translate is not None else chunks, reservation)
            reservation.release_with(events)
            return StreamingResponse(events, media_type="text/event-stream")

        async def answer() -> BaseModel:
            try:
                result = await until_disconnected(request, collect(engine, job, on_delta))
            finally:
                reservation.release()
            return await asyncio.to_thread(build, result)

        response = JSONWhenSent(answer)
        reservation.release_with(response)
        return response

    @app.get("/health", responses=ERRORS)
    async def health() -> JSONResponse:
        if state.engine is not None and not state.engine.is_alive:
            return error_response(503, "the engine has stopped after an internal error")
        return JSONResponse({"status": "ok"})

    @app.get("/ready", responses=ERRORS)
    async def ready() -> JSONResponse:
        state.ready_engine()
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", response_class=Response, responses=ERRORS, dependencies=[Depends(authorize_metrics)])
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", response_model=p.ModelList, responses=ERRORS, dependencies=[Depends(authorize)])
    async def models() -> p.ModelList:
        engine = state.ready_engine()
        created, max_model_len = state.settings.created, engine.info.max_model_len
        cards = [p.ModelCard(id=state.model_name, created=created, max_model_len=max_model_len)]
        cards += [p.ModelCard(id=name, created=created, max_model_len=max_model_len, root=str(path),
                              parent=state.model_name) for name, path in engine.loras.items()]
        return p.ModelList(data=cards)

    @app.post("/v1/completions", response_model=p.CompletionResponse, responses=STREAMING,
              dependencies=[Depends(authorize)])
    async def completions(body: p.CompletionRequest, request: Request):
        engine, lora = admit(body)
        info = engine.info
        tokenizer = info.tokenizer
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        items = body.prompt_list
        settings = state.settings
        # Sizes first, before anything is tokenized.
        check_prompts(items, max_tokens, info, settings.max_prompts_per_request,
                      settings.prompt_char_limit(info.max_model_len))
        check_token_fields(body, info.vocab_size)
        guide, guide_field = request_guide(body)
        reservation = state.admission.reserve(len(items) * body.n)
        if body.suffix is not None and (tokenizer is None or tokenizer.fim_token_ids is None):
            raise APIError(400, "suffix (fill in the middle) needs a model whose vocabulary has FIM tokens; this "
                                "one has none", param="suffix")
        try:
            prompts = await asyncio.to_thread(to_prompts, items, tokenizer, body.echo, body.suffix)
            for prompt in prompts:  # max_tokens 0: the engine still makes one token
                check_length(len(prompt.token_ids), max(max_tokens, 1), info.max_model_len, "prompt")
            if guide is not None:
                await asyncio.to_thread(compile_guide, info, guide, guide_field)
            # max_tokens 0 (with echo): the engine makes one token, which the response leaves out.
            params = sampling_params(body, max(max_tokens, 1), body.logprobs, guide, info.sampling_defaults)
            if body.echo and body.logprobs is not None:  # the echoed prompt's tokens come with theirs
                params = params.replace(prompt_logprobs=max(body.logprobs, body.prompt_logprobs or 0))
            if body.suffix is not None:  # the middle ends at the end of text or the model's FIM end token
                params = params.replace(stop_token_ids=(*params.stop_token_ids, *sorted(tokenizer.fim_stop_ids)))
            job = Job(new_id("cmpl"), prompts, params, lora or state.model_name, body.logprobs, lora,
                      prompt_only=max_tokens == 0, num_prompt_logprobs=body.prompt_logprobs)
            echo = body.echo
            return respond(engine, job, Reply(body.stream, body.include_usage, echo), request, chat=False,
                           reservation=reservation,
                           build=lambda result: completion_response(job, result, tokenizer, echo))
        except BaseException:
            reservation.release()
            raise

    @app.post("/v1/chat/completions", response_model=p.ChatCompletionResponse, responses=STREAMING,
              dependencies=[Depends(authorize)])
    async def chat_completions(body: p.ChatCompletionRequest, request: Request):
        engine, job, parsed, reasoning, reservation = await prepare_chat(body)
        tokenizer = engine.info.tokenizer
        return respond(engine, job, Reply(body.stream, body.include_usage, echo=False, tools=parsed,
                                          reasoning=reasoning), request, chat=True, reservation=reservation,
                       build=lambda result: chat_response(job, result, tokenizer, parsed, reasoning))

    @app.post("/v1/responses", responses=STREAMING, dependencies=[Depends(authorize)])
    async def responses(body: p.ResponsesRequest, request: Request):
        """OpenAI's Responses API, run as the chat completion it translates to (server/responses.py)."""
        history = stored_response(body.previous_response_id, "previous_response_id").messages \
            if body.previous_response_id is not None else []
        chat_json, conversation = chat_body(body, history)
        try:
            chat = p.ChatCompletionRequest.model_validate(chat_json)
        except ValidationError as error:
            raise RequestValidationError(error.errors()) from None
        engine, job, parsed, reasoning, reservation = await prepare_chat(chat)
        tokenizer = engine.info.tokenizer

        def keep(response: dict) -> None:  # the conversation, its answer last, for a later previous_response_id
            state.responses.put(response, [*conversation, *output_messages(response["output"])])

        events = ResponseEvents(body, new_item_id("resp"), job.model_name, keep if body.store is not False else None)
        return respond(engine, job, Reply(body.stream, True, echo=False, tools=parsed, reasoning=reasoning,
                                          translate=events.translate), request, chat=True, reservation=reservation,
                       build=lambda result: ResponseBody(events.from_chat(chat_response(job, result, tokenizer,
                                                                                        parsed, reasoning))))

    @app.get("/v1/responses/{response_id}", responses=ERRORS, dependencies=[Depends(authorize)])
    async def get_response(response_id: str) -> JSONResponse:
        return JSONResponse(stored_response(response_id, "response_id").response)

    @app.delete("/v1/responses/{response_id}", responses=ERRORS, dependencies=[Depends(authorize)])
    async def delete_response(response_id: str) -> JSONResponse:
        if not state.responses.delete(response_id):
            raise not_stored(response_id, "response_id")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    def stored_response(response_id: str, param: str):
        stored = state.responses.get(response_id)
        if stored is None:
            raise not_stored(response_id, param)
        return stored

    async def prepare_chat(body: p.ChatCompletionRequest) -> tuple[AsyncLLMEngine, Job, ToolUse | None,
                                                                   Reasoning | HarmonyReasoning | None, Reservation]:
        """A chat request's job, ready to run, how its replies are read (tool calls, reasoning), and the
        admission it holds (the caller releases it)."""
        engine, lora = admit(body)
        info = engine.info
        tokenizer = chat_tokenizer(info, body, state.settings.prompt_char_limit(info.max_model_len))
        check_token_fields(body, info.vocab_size)
        guide, guide_field = request_guide(body)
        fmt = tool_format(tokenizer.chat_template)
        tools = ToolUse.of(body, fmt)
        if tools is not None and tools.forced:
            if guide is not None:  # the forced call's grammar is the output's constraint
                raise APIError(400, f"{guide_field} cannot be combined with a forced tool call (tool_choice "
                                    f"{body.tool_choice if isinstance(body.tool_choice, str) else 'naming a function'})",
                               param=guide_field)
            try:
                guide, guide_field = tools.guide(), "tool_choice"
            except ValueError as e:  # no tool of that name, or a schema the notation of its calls cannot follow
                raise APIError(400, str(e), param="tool_choice") from None
        reservation = state.admission.reserve(body.n)
        try:
            ids, images = await chat_prompt_ids(tokenizer, body, fmt, tools,
                                                state.settings.allow_special_tokens_in_content, state.vision)
            requested = body.max_completion_tokens or body.max_tokens
            max_tokens = requested if requested is not None else max(info.max_model_len - len(ids), 1)
            check_length(len(ids), max_tokens, info.max_model_len, "messages")
            begun = state.harmony.prefix_of(ids, tokenizer) if state.harmony is not None else ""
            if guide is not None and state.harmony is not None and begun == HARMONY_REPLY:
                # The guide holds for the answer; the analysis before it is free (server/harmony.py).
                guide = state.harmony.guide_answer(guide, forced_call=guide_field == "tool_choice")
            if guide is not None:
                await asyncio.to_thread(compile_guide, info, guide, guide_field)
            num_top = (body.top_logprobs or 0) if body.logprobs else None
            # A chat prompt's text is never echoed: only its ids are kept.
            params = sampling_params(body, max_tokens, num_top, guide, info.sampling_defaults)
            parsed = tools  # the reply holds tool calls only when tools are in use
            reasoning = None
            if state.harmony is not None:  # its analysis channel apart, its headers gone (server/harmony.py)
                if body.reasoning_budget is not None:
                    raise APIError(400, "reasoning_budget is not supported for a model that writes harmony's messages "
                                        "(GPT-OSS); its reasoning_effort sets how long it thinks",
                                   param="reasoning_budget")
                include = body.include_reasoning and state.settings.reasoning_parser != "none"
                reasoning = HarmonyReasoning(begun, include)
            elif state.reasoning is not None:
                # The engine follows the block too: a guide holds after it, a budget bounds it.
                reasoning = Reasoning(state.reasoning, state.reasoning.opened_by(ids), body.include_reasoning)
                budget = body.reasoning_budget if body.reasoning_budget is not None \
                    else state.settings.reasoning_budget
                block = ThinkBlock(reasoning.fmt.start_id, reasoning.fmt.end_id, reasoning.opened)
                params = params.replace(reasoning=block, reasoning_budget=budget)
            elif body.reasoning_budget is not None:
                raise APIError(400, "reasoning_budget needs a reasoning model (<think> and </think> tokens) "
                                    "served with its reasoning parser", param="reasoning_budget")
            # The tower last, once every check that can refuse the request has passed: seconds of CPU.
            encoded = await engine.encode_images(images) if images else None
            job = Job(new_id("chatcmpl"), [Prompt(ids, "", encoded)], params, lora or state.model_name, num_top, lora,
                      num_prompt_logprobs=body.prompt_logprobs)
            return engine, job, parsed, reasoning, reservation
        except BaseException:
            reservation.release()
            raise

    return app


@dataclass(frozen=True)
class Reply:
    """How a request wants its answer: the only fields of its body kept once its job is prepared."""

    stream: bool
    include_usage: bool
    echo: bool
    tools: ToolUse | None = None  # the reply's text is parsed for tool calls (its format, its request's tools)
    reasoning: Reasoning | HarmonyReasoning | None = None  # a chat reply's reasoning is split from its content
    # Turns the chat or completion stream's events into another API's (the Responses API's); None: as they are.
    translate: Callable[[AsyncIterator[str]], AsyncIterator[str]] | None = None


def not_stored(response_id: str, param: str) -> APIError:
    return APIError(404, f"no stored response {response_id!r}: responses are kept in the memory of the process "
                         "that answered them, the most recent ones, unless stored with store: false",
                    param=param, code="response_not_found")


class ResponseBody(BaseModel):
    """A body built as a plain dict (the Responses API's object), sent through JSONWhenSent as it is."""

    model_config = ConfigDict(extra="allow")

    def __init__(self, data: dict) -> None:
        super().__init__(**data)


class JSONWhenSent(Response):
    """A JSON response whose body `produce` computes when the response is sent, not in the route, so that
    FastAPI has dropped the parsed request before the generation. An APIError from `produce` still
    becomes its error response (the app's handlers wrap the sending too)."""

    def __init__(self, produce: Callable[[], Awaitable[BaseModel]]) -> None:
        super().__init__(media_type="application/json")
        self.produce = produce

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self.produce()
        await Response(body.model_dump_json(), media_type="application/json")(scope, receive, send)


def forget_body(request: Request) -> None:
    """Drops the body Starlette keeps on the request for the request's whole life, its bytes and its parsed
    JSON (up to --max-body-bytes of each, often more as objects), once the route has taken what it needs
    from it: a request waiting for a long generation would hold them to the end."""
    for cached in ("_body", "_json"):
        request.__dict__.pop(cached, None)


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
