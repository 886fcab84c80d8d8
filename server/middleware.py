"""Pure ASGI middleware around the app: the body size limit, and the count of requests in flight."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import error_response

if TYPE_CHECKING:
    from server.app import ServerState


class BodyLimit:
    """413 for a body over `limit` bytes, declared (content-length) or sent chunked.

    The body is read here, up to the limit, and replayed to the app as one message. Refusing from inside
    the app's `receive` instead does not work: FastAPI's body parser turns any exception raised while it
    reads into a 400 "There was an error parsing the body"."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await self.too_large(scope, receive, send)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left mid-body: no one to answer
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return await self.too_large(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        del chunks

        async def replay() -> Message:
            # The body once, then the client's own messages (http.disconnect, which streaming watches for).
            # The body is not kept here after the app has it: the app holds what it needs.
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()

        await self.app(scope, replay, send)

    async def too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(413, f"request body larger than {self.limit} bytes")
        await response(scope, receive, send)


class InFlight:
    """Counts the HTTP requests between their arrival and the end of their response (`state.num_requests`),
    so that a drain at shutdown also waits for those still being read, tokenized or rendered before they
    reach the engine, and for responses still being built or sent after it."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.state.num_requests += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.num_requests -= 1
