"""One HTTP request carried from the ingress to a replica, and run there through the replica's own
FastAPI app as an in-process ASGI call, so replicas answer exactly as `ladder serve` does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

REPLICA_HEADER = b"x-ladder-replica"


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    prefix_hashes: tuple[int, ...] = ()  # read by the router (deploy/prefix_router.py), not by the replica


async def call_asgi(app, request: ForwardedRequest, replica_id: str) -> AsyncIterator[list[dict]]:
    """Run `request` through `app`, yielding its ASGI send messages in batches: whatever the app has sent
    since the last batch, so a fast stream crosses the network in fewer, larger pieces. Cancelling the
    iteration (the client went away) tells the app the client disconnected and cancels it."""
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
        "root_path": "", "query_string": request.query_string, "headers": list(request.headers),
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "state": {},
    }
    sent: asyncio.Queue[dict | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_taken = False

    async def receive() -> dict:
        nonlocal body_taken
        if not body_taken:
            body_taken = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER, replica_id.encode())]}
        await sent.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await sent.put(None)

    task = asyncio.create_task(run())
    try:
        while True:
            batch = [await sent.get()]
            while not sent.empty():
                batch.append(sent.get_nowait())
            done = batch[-1] is None
            messages = [m for m in batch if m is not None]
            if messages:
                yield messages
            if done:
                break
        await task  # re-raises what the app raised after its last message
    finally:
        if not task.done():
            disconnected.set()
            task.cancel()
            try:
                await task
            except BaseException:  # noqa: BLE001, S110  (cancelled or failed: the client has gone)
                pass
