"""A streaming client for OpenAI-compatible servers that timestamps every server-sent event."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Self

import aiohttp

from loadtest.clock import Clock, SystemClock
from loadtest.config import LoadTestError
from loadtest.sse import SseParser
from loadtest.tokens import TokenCounter
from loadtest.workload import RequestSpec

# Failure kinds besides "http_<status>".
TIMEOUT = "timeout"
BROKEN_STREAM = "broken_stream"  # the stream stopped (or the connection dropped) before [DONE]
CONNECTION_ERROR = "connection_error"  # no response at all: refused, reset, closed before headers
ERROR_EVENT = "error_event"  # the server streamed an error object instead of tokens
BAD_RESPONSE = "bad_response"  # an event that is not the JSON of a completion chunk

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "responses": "/v1/responses"}
# How a Responses stream's last event ends it, as a chat choice's finish_reason would.
RESPONSE_ENDS = {"response.completed": "stop", "response.incomplete": "length"}


@dataclass
class RequestRecord:
    """What happened to one request. Times are seconds: `scheduled` and `sent` from the start of the
    run, the others from `sent`."""

    index: int
    scheduled: float | None  # when the schedule wanted it sent; None in a closed loop
    sent: float
    max_tokens: int
    finished: float = 0.0  # from the start of the run, when the request was over, failed or not
    ok: bool = False
    error_kind: str | None = None
    error: str | None = None
    ttft: float | None = None  # first event that carries text
    e2e: float | None = None  # [DONE], or the end of the body
    chunk_times: list[float] = field(default_factory=list)  # every event that carries text
    prompt_tokens: int | None = None
    prompt_tokens_source: str | None = None  # usage, tokenizer or estimate
    output_tokens: int | None = None
    output_tokens_source: str | None = None  # usage, tokenizer or chunks
    finish_reason: str | None = None

    @property
    def lag(self) -> float | None:
        return None if self.scheduled is None else self.sent - self.scheduled

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        times = self.chunk_times
        return [later - earlier for earlier, later in itertools.pairwise(times)]

    def fail(self, kind: str, message: str) -> None:
        self.ok, self.error_kind, self.error = False, kind, message[:300]


@dataclass(frozen=True)
class PreparedRequest:
    spec: RequestSpec
    body: bytes  # serialized before the run so the send path does no work that could lag


def api_root(base_url: str) -> str:
    """`http://host:port` from a base URL given with or without its /v1."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


def tcp_connector() -> aiohttp.BaseConnector:
    # No pool limit: a request must never wait for a free connection inside the client.
    return aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)


def fresh_connector() -> aiohttp.BaseConnector:
    """A connection of its own for every request (--no-keep-alive): for a server that closes idle
    keep-alive connections (llama.cpp's), where a pooled one may be closed as a request is written and the
    request would count as a connection error that is the client's, not the server's."""
    return aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, force_close=True)


class OpenAIClient:
    """`clock` stamps every request and event (the runner schedules on the same clock, so that send lag
    compares like with like); `connector` makes the connection pool, inside the running event loop."""

    def __init__(self, base_url: str, api_key: str | None, endpoint: str, timeout: float,
                 ignore_eos: bool = True, temperature: float = 0.0, extra_body: dict | None = None,
                 counter: TokenCounter | None = None, *, clock: Clock = SystemClock(),
                 connector: Callable[[], aiohttp.BaseConnector] = tcp_connector) -> None:
        self.root = api_root(base_url)
        self.endpoint = endpoint
        self.url = self.root + ENDPOINT_PATHS[endpoint]
        self.timeout = timeout
        self.ignore_eos = ignore_eos
        self.temperature = temperature
        self.extra_body = extra_body or {}
        self.counter = counter
        self.clock = clock
        self.connector = connector
        self.model: str | None = None
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        self._session = aiohttp.ClientSession(connector=self.connector(), headers=self.headers,
                                              timeout=aiohttp.ClientTimeout(total=None))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._session.close()

    async def list_models(self) -> list[str]:
        """The model ids at /v1/models (empty when the server does not list them); raises when the
        server cannot be reached at all."""
        url = self.root + "/v1/models"
        try:
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as response:
                if response.status != 200:
                    return []
                body = await response.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError) as error:
            raise LoadTestError(f"cannot reach the server at {self.root}: {describe(error)}") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            return []
        data = body.get("data") if isinstance(body, dict) else None
        return [m["id"] for m in data or () if isinstance(m, dict) and isinstance(m.get("id"), str)]

    async def fetch_metrics(self) -> str | None:
        """The Prometheus text at /metrics, or None when there is none."""
        try:
            async with self._session.get(self.root + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
                return await r.text() if r.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, UnicodeDecodeError):
            return None

    def prepare(self, spec: RequestSpec) -> PreparedRequest:
        body: dict = {"model": self.model, "max_tokens": spec.max_tokens, "temperature": self.temperature,
                      "stream": True, "stream_options": {"include_usage": True}}
        if self.endpoint == "chat":
            body["messages"] = list(spec.messages)
        elif self.endpoint == "responses":  # the conversation as input items; usage comes with the last event
            body = {"model": self.model, "max_output_tokens": spec.max_tokens, "temperature": self.temperature,
                    "stream": True, "input": list(spec.messages)}
        else:
            body["prompt"] = spec.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return PreparedRequest(spec, json.dumps(body).encode())

    async def send(self, request: PreparedRequest, origin: float, scheduled: float | None) -> RequestRecord:
        """Sends one request and reads its stream; never raises for a failed request."""
        sent_at = self.clock.now()
        record = RequestRecord(request.spec.index, scheduled, sent_at - origin, request.spec.max_tokens)
        try:
            await self._send(request, record, sent_at)
        finally:
            record.finished = self.clock.now() - origin
        return record

    async def _send(self, request: PreparedRequest, record: RequestRecord, sent_at: float,
                    retry_stale: bool = True) -> None:
        stream = _StreamState(record, sent_at, keep_text=self.counter is not None)
        try:
            # On the event loop's own clock: a timeout is a limit, not a figure, and needs no stamp of `clock`.
            async with asyncio.timeout(self.timeout):
                async with self._session.post(self.url, data=request.body) as response:
                    stream.got_headers = True
                    if response.status != 200:
                        record.fail(f"http_{response.status}", await error_text(response))
                        return
                    parser = SseParser()
                    async for chunk in response.content.iter_any():
                        now = self.clock.now()
                        for data in parser.feed(chunk):
                            stream.handle(data, now)
                        if stream.failed:
                            return
                    stream.end(self.clock.now())
        except TimeoutError:
            if not stream.done:
                record.fail(TIMEOUT, f"no complete answer within {self.timeout:g} s")
                return
            stream.end(self.clock.now())  # all was received; only the body's close was late
        except aiohttp.ClientError as error:
            if not stream.got_headers and retry_stale and is_stale_connection(error):
                # A pooled keep-alive connection the server had closed (llama.cpp's server closes after
                # each stream): the request never reached it. Once more on a fresh connection; the
                # request's clock keeps running from the first send.
                return await self._send(request, record, sent_at, retry_stale=False)
            if not stream.got_headers:
                record.fail(CONNECTION_ERROR, describe(error))
                return
            if not stream.done:
                record.fail(BROKEN_STREAM, describe(error))
                return
            stream.end(self.clock.now())
        if record.ok:
            self._count_tokens(record, request.spec, stream)

    def _count_tokens(self, record: RequestRecord, spec: RequestSpec, stream: _StreamState) -> None:
        usage = stream.usage or {}
        if isinstance(usage.get("prompt_tokens"), int):
            record.prompt_tokens, record.prompt_tokens_source = usage["prompt_tokens"], "usage"
        else:
            record.prompt_tokens, record.prompt_tokens_source = spec.prompt_tokens, spec.prompt_tokens_source
        if isinstance(usage.get("completion_tokens"), int):
            record.output_tokens, record.output_tokens_source = usage["completion_tokens"], "usage"
        elif self.counter is not None:
            record.output_tokens = self.counter.count("".join(stream.text))
            record.output_tokens_source = "tokenizer"
        else:
            record.output_tokens, record.output_tokens_source = len(record.chunk_times), "chunks"


class _StreamState:
    """Folds the events of one stream into its record."""

    def __init__(self, record: RequestRecord, sent_at: float, keep_text: bool) -> None:
        self.record = record
        self.sent_at = sent_at
        self.keep_text = keep_text
        self.text: list[str] = []
        self.usage: dict | None = None
        self.got_headers = False
        self.num_events = 0
        self.done = False
        self.failed = False

    def handle(self, data: str, now: float) -> None:
        if self.done or self.failed:
            return
        self.num_events += 1
        if data.strip() == "[DONE]":
            self.done = True
            self.record.e2e = now - self.sent_at
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            self._fail(BAD_RESPONSE, f"event is not JSON: {data[:100]!r}")
            return
        if not isinstance(event, dict):
            self._fail(BAD_RESPONSE, f"event is not a JSON object: {data[:100]!r}")
            return
        kind = event.get("type")
        if isinstance(kind, str) and (kind.startswith("response.") or kind == "error"):
            self._response_event(event, kind, now)
            return
        if event.get("error") is not None:
            error = event["error"]
            self._fail(ERROR_EVENT, str(error.get("message", error) if isinstance(error, dict) else error))
            return
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]  # servers that repeat usage in every event end with the total
        text = ""
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):  # chat: reasoning text counts as output too
                text += "".join(p for p in (delta.get("reasoning_content"), delta.get("reasoning"),
                                            delta.get("content")) if isinstance(p, str))
            elif isinstance(choice.get("text"), str):
                text += choice["text"]
            if choice.get("finish_reason"):
                self.record.finish_reason = choice["finish_reason"]
        self._text(text, now)

    def _text(self, text: str, now: float) -> None:
        if text:
            elapsed = now - self.sent_at
            if self.record.ttft is None:
                self.record.ttft = elapsed
            self.record.chunk_times.append(elapsed)
            if self.keep_text:
                self.text.append(text)

    def _response_event(self, event: dict, kind: str, now: float) -> None:
        """One of the Responses API's typed events: text deltas; the last event (completed, incomplete)
        with the usage; an error event or a failed response."""
        if kind == "error" or kind == "response.failed":
            error = event.get("message") or (event.get("response") or {}).get("error") or kind
            self._fail(ERROR_EVENT, str(error.get("message", error) if isinstance(error, dict) else error))
        elif kind == "response.output_text.delta" and isinstance(event.get("delta"), str):
            self._text(event["delta"], now)
        elif kind in RESPONSE_ENDS:
            usage = (event.get("response") or {}).get("usage")
            if isinstance(usage, dict):  # in the chat shape, for _count_tokens
                self.usage = {"prompt_tokens": usage.get("input_tokens"),
                              "completion_tokens": usage.get("output_tokens")}
            self.record.finish_reason = RESPONSE_ENDS[kind]
            self.done = True
            self.record.e2e = now - self.sent_at

    def end(self, now: float) -> None:
        """The body ended cleanly: a success if the stream said it was complete."""
        if self.failed:
            return
        if self.num_events == 0:
            self._fail(BAD_RESPONSE, "no server-sent events in the answer (does the server stream?)")
            return
        if not self.done and self.record.finish_reason is None:
            self._fail(BROKEN_STREAM, "the stream ended before [DONE]")
            return
        if self.record.e2e is None:  # no [DONE], but a finish_reason: the end of the body ends it
            self.record.e2e = now - self.sent_at
        self.done = True
        self.record.ok = True

    def _fail(self, kind: str, message: str) -> None:
        self.failed = True
        self.record.fail(kind, message)


async def error_text(response: aiohttp.ClientResponse) -> str:
    try:
        raw = await response.content.read(2000)
    except aiohttp.ClientError:
        return f"HTTP {response.status}"
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        error = json.loads(text).get("error")
        text = error.get("message", text) if isinstance(error, dict) else str(error or text)
    except (json.JSONDecodeError, AttributeError):
        pass
    return f"HTTP {response.status}: {text}" if text else f"HTTP {response.status}"


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def is_stale_connection(error: aiohttp.ClientError) -> bool:
    """A write to a pooled keep-alive connection that the server had already closed: the request body
    could not be sent (a refused connection or a server that hangs up after reading is a real error)."""
    return isinstance(error, aiohttp.ClientOSError) and not isinstance(error, aiohttp.ClientConnectorError)
