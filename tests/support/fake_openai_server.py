"""A deterministic OpenAI-shaped streaming server for loadtest's tests.

Plain asyncio HTTP/1.1 with keep-alive and chunked server-sent events. Each completion sends its
headers at once, its first token `ttft` seconds after the request arrived and token i at
ttft + i * itl (deadlines from the arrival, so lateness never accumulates), then a finish event,
a usage event and [DONE]. Faults are dealt by arrival order from a cycle: "ok", "500", "429",
"hang" (never answers), "close" (closes the connection without answering), "break" (closes it
halfway through the stream), "error_event" (streams an error object halfway through) and "json"
(answers 200 with a plain JSON body instead of a stream).

    POST /_control {"ttft": 0.05, "itl": 0.01, "faults": ["ok", "500"], "usage": true,
                    "ladder_metrics": false}   sets the behaviour and resets the statistics
    GET /_stats    {"num_requests", "max_in_flight", "arrivals": [seconds], "last_body",
                    "last_authorization"}

Its time comes from a loadtest `Clock`: in a process of its own (FakeServerProcess, or by hand) the real
clock with punctual sleeps; in-process, whatever clock the test gives, such as a virtual one.

Run by hand: python tests/support/fake_openai_server.py --port 8000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from server_process import ServerProcess, free_port

if TYPE_CHECKING:  # only for type checkers: run by hand, this file needs nothing but the standard library
    from loadtest.clock import Clock

BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, float("inf"))
MODEL = "fake-model"
SPIN_SECONDS = 0.002
DEFAULTS = {"ttft": 0.05, "itl": 0.01, "faults": [], "usage": True, "ladder_metrics": False}


class Histogram:
    def __init__(self) -> None:
        self.counts = [0] * len(BUCKETS)
        self.total = 0.0
        self.num = 0

    def observe(self, value: float) -> None:
        self.total += value
        self.num += 1
        for i, bound in enumerate(BUCKETS):
            if value <= bound:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f"# TYPE {name} histogram"]
        for bound, count in zip(BUCKETS, self.counts):
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {count}')
        return out + [f"{name}_sum {self.total}", f"{name}_count {self.num}"]


class PunctualClock:
    """The real clock, with sleeps that end within a few microseconds of their deadline: asyncio's timers
    wake up to a millisecond late, so the last stretch yields in a loop instead."""

    def now(self) -> float:
        return time.perf_counter()

    async def sleep(self, seconds: float) -> None:
        deadline = time.perf_counter() + seconds
        if seconds > SPIN_SECONDS:
            await asyncio.sleep(seconds - SPIN_SECONDS)
        while time.perf_counter() < deadline:
            await asyncio.sleep(0)


class FakeServer:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.behaviour = dict(DEFAULTS)
        self.in_flight = 0
        self.reset()
        self.histograms = {name: Histogram() for name in ("queue", "prefill", "decode", "ttft")}
        self.steps = {"schedule": 0.0, "prepare": 0.0, "forward": 0.0, "sample": 0.0}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = 0

    def configure(self, behaviour: dict) -> None:
        """Sets the behaviour (defaults for what is not given) and resets the statistics."""
        self.behaviour = {**DEFAULTS, **behaviour}
        self.reset()

    def reset(self) -> None:
        self.num_requests = 0
        self.num_connections = 0
        self.max_in_flight = self.in_flight
        self.arrivals: list[float] = []
        self.last_body: dict | None = None
        self.last_authorization: str | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            while True:
                request_line = await reader.readline()
                if not request_line:
                    return
                method, path, _ = request_line.decode().split(" ", 2)
                headers = {}
                while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    key, _, value = line.decode().partition(":")
                    headers[key.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if path.startswith("/v1/"):
                    self.last_authorization = headers.get("authorization")
                if not await self.route(method, path, body, reader, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()

    async def route(self, method: str, path: str, body: bytes, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter) -> bool:
        """Answers one request; False when the connection must close."""
        if method == "GET" and path == "/v1/models":
            return await send_json(writer, 200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        if method == "GET" and path == "/metrics":
            if not self.behaviour["ladder_metrics"]:
                return await send_json(writer, 404, {"detail": "Not Found"})
            return await send(writer, 200, "text/plain; version=0.0.4", self.metrics_text().encode())
        if method == "POST" and path == "/_control":
            self.configure(json.loads(body or b"{}"))
            return await send_json(writer, 200, {})
        if method == "GET" and path == "/_stats":
            return await send_json(writer, 200, {"num_requests": self.num_requests, "in_flight": self.in_flight,
                                                 "num_connections": self.num_connections,
                                                 "max_in_flight": self.max_in_flight, "arrivals": self.arrivals,
                                                 "last_body": self.last_body,
                                                 "last_authorization": self.last_authorization})
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            arrived = self.clock.now()
            self.arrivals.append(arrived)
            faults = self.behaviour["faults"]
            fault = faults[self.num_requests % len(faults)] if faults else "ok"
            self.num_requests += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                return await self.complete(json.loads(body), path.endswith("chat/completions"), fault,
                                           arrived, reader, writer)
            finally:
                self.in_flight -= 1
        return await send_json(writer, 404, {"detail": "Not Found"})

    async def complete(self, body: dict, chat: bool, fault: str, arrived: float, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> bool:
        self.last_body = body
        if fault == "close":
            return False
        if fault in ("500", "429"):
            return await send_json(writer, int(fault), {"error": {"message": f"injected {fault}", "code": fault}})
        if fault == "json":
            return await send_json(writer, 200, {"choices": [{"text": "not streamed"}]})
        ttft, itl = self.behaviour["ttft"], self.behaviour["itl"]
        num_tokens = int(body.get("max_tokens", 16))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        if chat:
            await send_event(writer, chunk(chat, None, role=True))
        if fault == "hang":
            await reader.read(1)  # until the client gives up and closes the connection
            return False
        for i in range(num_tokens):
            await self.clock.sleep(arrived + ttft + i * itl - self.clock.now())
            await send_event(writer, chunk(chat, f" tok{i}"))
            if fault == "break" and i == num_tokens // 2:
                writer.transport.abort()
                return False
            if fault == "error_event" and i == num_tokens // 2:
                await send_event(writer, {"error": {"message": "injected error event", "code": 500}})
                await send_event(writer, "[DONE]")
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                return True
        await send_event(writer, chunk(chat, "", finish_reason="length"))
        prompt = body.get("prompt") or " ".join(m.get("content", "") for m in body.get("messages", []))
        num_prompt = len(prompt.split())
        if self.behaviour["usage"] and (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": num_prompt, "completion_tokens": num_tokens,
                     "total_tokens": num_prompt + num_tokens}
            await send_event(writer, {"id": "x", "object": "chunk", "model": MODEL, "choices": [], "usage": usage})
        await send_event(writer, "[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        self.account(ttft, itl, num_prompt, num_tokens)
        return True

    def account(self, ttft: float, itl: float, num_prompt: int, num_tokens: int) -> None:
        queue = min(0.001, ttft / 2)
        for name, value in (("queue", queue), ("prefill", ttft - queue), ("decode", (num_tokens - 1) * itl),
                            ("ttft", ttft)):
            self.histograms[name].observe(value)
        for phase, share in (("schedule", 0.05), ("prepare", 0.1), ("forward", 0.8), ("sample", 0.05)):
            self.steps[phase] += share * (ttft + (num_tokens - 1) * itl)
        self.prompt_tokens += num_prompt
        self.generation_tokens += num_tokens
        self.finished += 1

    def metrics_text(self) -> str:
        lines = []
        for name, metric in (("queue", "ladder_request_queue_seconds"), ("prefill", "ladder_request_prefill_seconds"),
                             ("decode", "ladder_request_decode_seconds"),
                             ("ttft", "ladder_time_to_first_token_seconds")):
            lines += self.histograms[name].lines(metric)
        lines.append("# TYPE ladder_engine_step_seconds_total counter")
        lines += [f'ladder_engine_step_seconds_total{{phase="{p}"}} {s}' for p, s in self.steps.items()]
        lines += [f"ladder_prompt_tokens_total {self.prompt_tokens}",
                  f"ladder_generation_tokens_total {self.generation_tokens}",
                  f'ladder_requests_finished_total{{reason="length"}} {self.finished}',
                  "process_cpu_seconds_total 1.5"]
        return "\n".join(lines) + "\n"


def chunk(chat: bool, text: str | None, finish_reason: str | None = None, role: bool = False) -> dict:
    if chat:
        delta = {"role": "assistant", "content": ""} if role else {"content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        return {"id": "x", "object": "chat.completion.chunk", "model": MODEL, "choices": [choice]}
    choice = {"index": 0, "text": text, "finish_reason": finish_reason}
    return {"id": "x", "object": "text_completion", "model": MODEL, "choices": [choice]}


async def send_event(writer: asyncio.StreamWriter, data: dict | str) -> None:
    payload = f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
    writer.write(b"%x\r\n%s\r\n" % (len(payload), payload))
    await writer.drain()


async def send(writer: asyncio.StreamWriter, status: int, content_type: str, payload: bytes) -> bool:
    reason = {200: "OK", 404: "Not Found", 429: "Too Many Requests", 500: "Internal Server Error"}[status]
    writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    await writer.drain()
    return True


async def send_json(writer: asyncio.StreamWriter, status: int, body: dict) -> bool:
    return await send(writer, status, "application/json", json.dumps(body).encode())


class FakeServerProcess(ServerProcess):
    """The fake server in a child process of its own, so its timing does not share the test's GIL."""

    def __init__(self, log: Path | None = None) -> None:
        port = free_port()
        super().__init__([sys.executable, str(Path(__file__).resolve()), "--port", str(port)], port=port,
                         ready_path="/_stats", log=log, timeout=30.0)

    def configure(self, **behaviour: object) -> None:
        """Sets the behaviour (defaults for what is not given) and resets the statistics."""
        self._call("/_control", json.dumps(behaviour).encode())

    def stats(self) -> dict:
        return self._call("/_stats")

    def _call(self, path: str, data: bytes | None = None) -> dict:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only, never a proxy
        with opener.open(self.url + path, data=data, timeout=10) as response:
            return json.loads(response.read())

    def close(self) -> None:
        self.stop(grace=5.0)


async def serve(port: int) -> None:
    fake = FakeServer(PunctualClock())
    server = await asyncio.start_server(fake.handle, "127.0.0.1", port, backlog=1024)
    print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port, printed as 'PORT n'")
    try:
        asyncio.run(serve(parser.parse_args().port))
    except KeyboardInterrupt:
        sys.exit(0)
