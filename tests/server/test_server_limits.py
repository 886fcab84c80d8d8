"""Overload, faults, shutdown and a schema fuzz, on a tiny model so they run quickly."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from in_process_server import InProcessServer, make_state
from schemathesis import checks
from server_process import LadderServer
from waiting import wait_until

from engine.async_engine import MAX_CONSECUTIVE_STEP_FAILURES
from server.app import create_app


def test_full_queue_gets_429_with_retry_after(tiny_dir):
    server = InProcessServer(make_state(tiny_dir, max_queue=2))
    release = threading.Event()
    try:
        real = server.state.engine.engine.runner.forward

        def held(inputs):  # the first step waits for the test: both streams stay in flight until then
            release.wait(60)
            return real(inputs)

        server.state.engine.engine.runner.forward = held
        body = {"prompt": "hi", "max_tokens": 8, "ignore_eos": True, "stream": True}
        streams: list[list[str]] = []

        def stream() -> None:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                streams.append([line for line in r.iter_lines() if line.startswith("data: ")])

        threads = [threading.Thread(target=stream) for _ in range(2)]
        for thread in threads:
            thread.start()
        wait_until(lambda: server.state.admission.num_sequences == 2, what="both streams admitted")
        limited = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, timeout=30)
        release.set()
        for thread in threads:
            thread.join(60)
        assert limited.status_code == 429
        assert limited.headers["retry-after"] == "1" and limited.json()["error"]["type"] == "rate_limit_error"
        assert len(streams) == 2 and all(events[-1] == "data: [DONE]" for events in streams)
    finally:
        release.set()
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
    proc = LadderServer("--model", str(tiny_dir), "--kv-cache-memory", "0.01", "--max-model-len", "512",
                         "--shutdown-timeout", "30", log=tmp_path / "server.log")
    try:
        events = []
        with httpx.stream("POST", proc.url + "/v1/completions", timeout=60,
                          json={"prompt": "hi", "max_tokens": 300, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            events.append(next(lines))
            proc.terminate()
            wait_until(lambda: httpx.get(proc.url + "/ready", timeout=5).status_code == 503, what="/ready says 503")
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


def test_text_the_vocabulary_cannot_write_is_a_400(fuzz_app):
    """A body the fuzzer once found answered with a 500 (the guide refused a token its own mask allowed): a
    choice with a byte no token holds is a 400 that names it, before anything runs; a regex that forces such
    text is a 400 with the reason when it is reached."""
    from fastapi.testclient import TestClient

    client = TestClient(fuzz_app)  # no lifespan: the module's engine stays up for the other tests
    choice = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, "guided_choice": [
        "\U000d5dba", "\u00bb\u00ee\U000aa364 \u0006"]})
    assert choice.status_code == 400 and "choice 1 cannot be written" in choice.json()["error"]["message"]
    forced = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, "temperature": 0,
                                                  "guided_regex": "\u00bb\u00ee\U000aa364"})
    assert forced.status_code == 400 and "requires byte 0xF2 next" in forced.json()["error"]["message"]


def test_a_stream_interval_below_one_is_refused_in_one_line(capsys):
    from ladder.cli import main

    assert main(["serve", "--stream-interval", "0"]) == 1
    assert capsys.readouterr().err.strip() == "ladder serve: error: --stream-interval must be at least 1, got 0"
