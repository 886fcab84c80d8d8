"""Overload, faults, shutdown and a schema fuzz, on a tiny model so they run quickly."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import schemathesis
from schemathesis import checks
import uvicorn
from hypothesis import HealthCheck, given, settings

from engine import EngineConfig, LLMEngine
from engine.async_engine import MAX_CONSECUTIVE_STEP_FAILURES, AsyncLLMEngine
from server.app import ServerSettings, ServerState, create_app
from server_process import ServerProcess, free_port
from tiny_models import make_tiny_chat_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "tiny-chat")


def make_state(tiny_dir, step_timeout: float | None = None, max_model_len: int = 256, **settings) -> ServerState:
    state = ServerState(ServerSettings(**settings))
    engine = LLMEngine(EngineConfig(model=str(tiny_dir), kv_cache_memory_gib=0.01, max_model_len=max_model_len,
                                    max_num_seqs=8))
    state.attach(AsyncLLMEngine(engine, step_timeout=step_timeout))
    return state


class InProcessServer:
    """A real uvicorn server in a thread, so tests can reach into its engine."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(state), port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.state.engine.shutdown()


def test_full_queue_gets_429_with_retry_after(tiny_dir):
    server = InProcessServer(make_state(tiny_dir, max_queue=2))
    try:
        real = server.state.engine.engine.runner.forward

        def slow(inputs):  # keep requests in flight long enough to fill the queue
            time.sleep(0.05)
            return real(inputs)

        server.state.engine.engine.runner.forward = slow
        body = {"prompt": "hi", "max_tokens": 250, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as first, \
                httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as second:
            streams = [first.iter_lines(), second.iter_lines()]  # keep the iterators: dropping one closes it
            for lines in streams:
                next(lines)  # admitted and streaming
            limited = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
        assert limited.status_code == 429
        assert limited.headers["retry-after"] == "1" and limited.json()["error"]["type"] == "rate_limit_error"
    finally:
        server.stop()


def test_forward_fault_returns_errors_and_health_turns_503(tiny_dir):
    """A forward that always fails: each request gets a 500 without internals; after
    MAX_CONSECUTIVE_STEP_FAILURES failed steps in a row the engine is dead and health says so."""
    server = InProcessServer(make_state(tiny_dir))
    try:
        assert httpx.get(server.url + "/health").status_code == 200

        def broken(_inputs):
            raise RuntimeError("injected fault in /secret/path")

        server.state.engine.engine.runner.forward = broken
        for attempt in range(MAX_CONSECUTIVE_STEP_FAILURES):
            assert httpx.get(server.url + "/health").status_code == 200  # it recovered after each failure
            plain = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
            assert plain.status_code == 500 and "/secret/path" not in plain.text
        assert httpx.get(server.url + "/health").status_code == 503
        assert httpx.get(server.url + "/ready").status_code == 503
        after = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
        assert after.status_code == 503
    finally:
        server.stop()


def test_a_stream_interval_groups_tokens_and_keeps_the_text(tiny_dir):
    """--stream-interval 3: the first token goes alone, then events of 3 tokens, the end at once; the
    text is the non-streamed text and the usage counts every token."""
    server = InProcessServer(make_state(tiny_dir, stream_interval=3))
    try:
        body = {"prompt": "hello there", "max_tokens": 11, "ignore_eos": True, "temperature": 0, "logprobs": 0}
        whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        events = []
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line.removeprefix("data: ")))
        chunks = [e["choices"][0] for e in events if e["choices"]]
        assert [len(c["logprobs"]["tokens"]) for c in chunks] == [1, 3, 3, 3, 1]
        assert chunks[-1]["finish_reason"] == "length" and all(c["finish_reason"] is None for c in chunks[:-1])
        assert "".join(c["text"] for c in chunks) == whole["choices"][0]["text"]
        assert events[-1]["usage"]["completion_tokens"] == 11
    finally:
        server.stop()


def test_stream_gets_a_final_error_event_when_the_engine_dies(tiny_dir):
    server = InProcessServer(make_state(tiny_dir))
    try:
        calls = {"n": 0}
        real = server.state.engine.engine.runner.forward

        def dies_later(inputs):
            calls["n"] += 1
            if calls["n"] > 3:
                raise RuntimeError("injected fault")
            return real(inputs)

        server.state.engine.engine.runner.forward = dies_later
        with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                          json={"prompt": "hi", "max_tokens": 50, "ignore_eos": True, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert "error" in json.loads(events[-2][6:])
    finally:
        server.stop()


def test_sigterm_lets_the_stream_finish_then_exits(tiny_dir, tmp_path):
    proc = ServerProcess("--model", str(tiny_dir), "--kv-cache-memory", "0.01", "--max-model-len", "512",
                         "--shutdown-timeout", "30", log=tmp_path / "server.log")
    try:
        events = []
        with httpx.stream("POST", proc.url + "/v1/completions", timeout=60,
                          json={"prompt": "hi", "max_tokens": 300, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            events.append(next(lines))
            proc.terminate()
            time.sleep(0.3)
            assert httpx.get(proc.url + "/ready", timeout=5).status_code == 503
            refused = httpx.post(proc.url + "/v1/completions", json={"prompt": "x"}, timeout=5)
            assert refused.status_code == 503
            events.extend(lines)
        data = [e for e in events if e.startswith("data: ")]
        assert data[-1] == "data: [DONE]"
        assert json.loads(data[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.proc.wait(30) == 0
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def fuzz_app(tiny_dir):
    # A short context bounds every generated answer (a body without max_tokens runs to the context's end,
    # n times over): each case stays well inside the client's 10 s timeout on a busy machine.
    state = make_state(tiny_dir, max_model_len=96)
    yield create_app(state)
    state.engine.shutdown()


def test_fuzzed_requests_get_no_5xx_and_fit_the_schema(fuzz_app):
    """No 5xx, and every response fits the schema, for inputs generated from the API's own OpenAPI."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            # Schema-valid bodies may still be refused at run time (a prompt plus max_tokens over the
            # context is a 400), so acceptance of every schema-valid body is not asked for.
            case.call_and_validate(checks=[checks.not_a_server_error, checks.response_schema_conformance,
                                           checks.content_type_conformance, checks.negative_data_rejection])

        check()


def test_a_stream_interval_below_one_is_refused_in_one_line(capsys):
    from ladder.cli import main

    assert main(["serve", "--stream-interval", "0"]) == 1
    assert capsys.readouterr().err.strip() == "ladder serve: error: --stream-interval must be at least 1, got 0"
