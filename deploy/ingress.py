"""The application's HTTP entry: reads a request, hashes its prompt's leading blocks for the router, and
relays it to an engine replica and the replica's answer back, byte for byte.

The ingress holds no model. It answers /health and /metrics (the router's counts) itself; every other
route, /ready included, is the replicas' `ladder serve` app. A replica that dies before answering gets
the request once more on another replica (nothing was sent back yet); one that dies mid-stream ends the
stream with an error event, as an engine failure does in `ladder serve`.

With an API key, a request for anything but the public pages and probes (server/access.py `is_public`,
the same list `ladder serve` uses; /metrics needs the key here, its router counts include prefix hits)
must carry it as `Authorization: Bearer KEY`: one without it is answered 401 before its body is read, so
it costs a header comparison and nothing more. The replicas check the key again.
"""

from __future__ import annotations

import logging

from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from deploy.forwarding import ForwardedRequest
from deploy.prefix_key import request_prefix
from deploy.routing_stats import STATS
from server.access import INVALID_KEY, bearer_matches, check_key, is_public
from server.errors import error_response, sse_error

log = logging.getLogger("ladder.ingress")
REPLICA_GONE = "the replica serving this request stopped; retry"
class BodyTooLarge(Exception):
    pass


class LadderIngress:
    def __init__(self, replicas: DeploymentHandle, max_body_bytes: int = 20 << 20,
                 api_key: str | None = None) -> None:
        # _by_reference=False: each streamed item goes straight to this process over the replica's gRPC
        # server instead of through Ray's object store and the owner's reports, which costs both this
        # process and the replica's Serve threads less CPU per streamed token.
        self.replicas = replicas.options(method_name="forward", stream=True, _by_reference=False)
        self.max_body_bytes = max_body_bytes
        self.api_key = check_key(api_key)

    def authorized(self, request: Request) -> bool:
        """The bearer key check of `ladder serve` (server/app.py), on the headers alone."""
        # /metrics here is the router's counts, prefix hits among them: behind the key like the server's.
        if self.api_key is None or is_public(request.method, request.url.path, metrics_need_key=True):
            return True
        return bearer_matches(request.headers.get("authorization", ""), self.api_key)

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if path == "/health":
            return JSONResponse({"status": "ok"})
        if not self.authorized(request):  # before the body is read: a request without the key costs nothing
            return error_response(401, INVALID_KEY, code="invalid_api_key")
        if path == "/metrics":
            return Response(STATS.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
        try:
            body = await self.read_body(request)
        except BodyTooLarge:
            return error_response(413, f"request body larger than {self.max_body_bytes} bytes")
        forwarded = ForwardedRequest(request.method, path, request.scope.get("query_string", b""),
                                     tuple(request.scope["headers"]), body, request_prefix(path, body))
        for attempt in range(2):
            stream: DeploymentResponseGenerator = self.replicas.remote(forwarded)
            try:
                first = await stream.__anext__()
            except RayActorError as error:
                log.warning("replica died before answering (attempt %d): %s", attempt + 1, type(error).__name__)
                continue
            except StopAsyncIteration:
                return error_response(500, "the replica sent no response")
            return RelayedResponse(first, stream)
        return error_response(503, REPLICA_GONE)

    async def read_body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            raise BodyTooLarge
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise BodyTooLarge
            chunks.append(chunk)
        return b"".join(chunks)


def ingress_asgi_app(ingress: LadderIngress):
    """The ingress as a plain ASGI app, for an HTTP server of its own outside Serve (`ladder serve --ray`):
    no Serve proxy in front, so each streamed event crosses one process boundary fewer."""

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":  # uvicorn runs with lifespan off; websockets are not served
            return
        response = await ingress(Request(scope, receive))
        await response(scope, receive, send)

    return app


class RelayedResponse(Response):
    """The replica's ASGI messages, sent on as they come. `first` starts with http.response.start."""

    def __init__(self, first: list[dict], stream: DeploymentResponseGenerator) -> None:
        self.first, self.stream = first, stream
        start = first[0]
        self.status_code = start["status"]
        self.raw_headers = list(start.get("headers", []))
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        is_sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in self.raw_headers)
        finished = False
        try:
            for message in self.first:
                await send(message)
                finished = is_last(message)
            while not finished:
                try:
                    messages = await self.stream.__anext__()
                except StopAsyncIteration:
                    break
                for message in messages:
                    await send(message)
                    finished = is_last(message)
        except RayActorError:
            if is_sse:  # the stream's own way of failing, then its end
                tail = (sse_error(503, REPLICA_GONE) + "data: [DONE]\n\n").encode()
                await send({"type": "http.response.body", "body": tail, "more_body": False})
                finished = True
        finally:
            if not finished:  # the client left, or the replica ended without a last message
                self.stream.cancel()
        if not finished:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def is_last(message: dict) -> bool:
    return message["type"] == "http.response.body" and not message.get("more_body", False)
