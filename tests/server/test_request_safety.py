"""Hostile or awkward request bodies on a tiny model: text that is not valid Unicode, bodies too large for
their declared size, content parts by the hundred thousand; what a request keeps while it generates; and
logprobs detokenized off the event loop while streaming."""

from __future__ import annotations

import gc
import json
import logging
import threading

import httpx
import pytest
from in_process_server import InProcessServer, make_state
from starlette.requests import Request
from waiting import wait_until

from server import protocol as p

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def server(tiny_dir):
    running = InProcessServer(make_state(tiny_dir, max_body_bytes=4 << 20))
    yield running
    running.stop()


def post_raw(server, path: str, raw: bytes | object, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=60,
                      **kwargs)


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


# Raw JSON, since json.dumps would refuse the lone surrogate these bodies carry as a `\ud800` escape.
SURROGATES = [
    (CHAT, r'{"messages": [{"role": "user", "content": "hi \ud800"}]}', "messages.0.content"),
    (CHAT, (r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, '
            r'{"type": "text", "text": "\udfff b"}]}]}'), "messages.0.content.1.text"),
    (CHAT, r'{"messages": [{"role": "user", "content": "hi", "name": "\ud83d"}]}', "messages.0.name"),
    (CHAT, r'{"messages": [{"role": "user", "content": "hi"}], "stop": "\ud800"}', "stop"),
    (CHAT, r'{"messages": [{"role": "user", "content": "hi"}], "user": "x\udc00"}', "user"),
    (COMPLETIONS, r'{"prompt": "hi \ud800"}', "prompt"),
    (COMPLETIONS, r'{"prompt": ["ok", "\ud800"]}', "prompt"),
    (COMPLETIONS, r'{"prompt": "hi", "stop": ["ok", "\udbff"]}', "stop.1"),
    (COMPLETIONS, r'{"prompt": "hi", "model": "\ud800"}', "model"),
]


@pytest.mark.parametrize("path,raw,field", SURROGATES, ids=[f for _, _, f in SURROGATES])
def test_a_lone_surrogate_in_any_string_is_a_400_naming_the_field(server, path, raw, field, caplog):
    caplog.set_level(logging.ERROR)
    error = assert_openai_error(post_raw(server, path, raw.encode()), 400)
    assert error["param"].startswith(field) and error["message"].startswith(error["param"] + ": ")
    assert "lone surrogate" in error["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no traceback in the log


def test_a_surrogate_pair_is_one_character_and_fine(server):
    raw = r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d\ude00"}]}], "max_tokens": 1}'
    assert post_raw(server, CHAT, raw.encode()).status_code == 200
    raw = r'{"prompt": "\ud83d\ude00", "stop": ["\ud83d\ude00"], "max_tokens": 1}'
    assert post_raw(server, COMPLETIONS, raw.encode()).status_code == 200


def chunks(data: bytes, size: int = 1 << 16):
    for start in range(0, len(data), size):
        yield data[start:start + size]


def test_a_chunked_body_over_the_limit_is_a_413(server):
    limit = server.state.settings.max_body_bytes
    big = json.dumps({"prompt": "a" * (5 << 20)}).encode()
    assert len(big) > limit
    # A generator body goes out chunked, with no content-length.
    error = assert_openai_error(post_raw(server, COMPLETIONS, chunks(big)), 413)
    assert str(limit) in error["message"]
    assert_openai_error(post_raw(server, COMPLETIONS, big), 413)  # declared too large: still 413
    # A chunked body within the limit reaches the route whole.
    small = json.dumps({"prompt": "hello " * 100, "max_tokens": 2}).encode()
    answered = post_raw(server, COMPLETIONS, chunks(small, 100))
    assert answered.status_code == 200 and answered.json()["usage"]["completion_tokens"] == 2


def parts_body(num_parts: int, num_messages: int, first: str = "", **fields) -> dict:
    """`num_parts` text parts over `num_messages` messages: each message's first part says `first`, the
    rest are empty."""
    per_message = -(-num_parts // num_messages)
    messages = []
    for start in range(0, num_parts, per_message):
        count = min(per_message, num_parts - start)
        parts = [{"type": "text", "text": first if i == 0 else ""} for i in range(count)]
        messages.append({"role": "user", "content": parts})
    return {"messages": messages, "max_tokens": 2, **fields}


def test_content_parts_are_bounded_per_request(server):
    bound = p.MAX_TOTAL_CONTENT_PARTS
    # Each message is within its own bound (MAX_CONTENT_PARTS), the request is not.
    over = httpx.post(server.url + CHAT, json=parts_body(bound + 1, 3), timeout=60)
    error = assert_openai_error(over, 400)
    assert error["param"] == "messages" and f"{bound + 1} content parts" in error["message"]
    assert str(bound) in error["message"]
    # The ~155,000 empty parts a 4 MiB body holds: refused the same way.
    flood = json.dumps(parts_body(155_040, 152), separators=(",", ":")).encode()
    assert len(flood) <= server.state.settings.max_body_bytes
    assert f"{155_040} content parts" in assert_openai_error(post_raw(server, CHAT, flood), 400)["message"]
    assert httpx.post(server.url + CHAT, json=parts_body(bound, 2), timeout=60).status_code == 200


MARKER = "zq-held-part-"


def live_request_objects() -> dict[str, int]:
    """What of the test's requests is still alive, counted in the collector's objects."""
    gc.collect()
    counts = {"parsed parts": 0, "raw part lists": 0, "cached bodies": 0}
    parsed = {p.TextPart, p.ChatMessage, p.ChatCompletionRequest}
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: some objects of torch's warn when asked
        if kind in parsed:
            counts["parsed parts"] += 1
        elif kind is list and obj and type(obj[0]) is dict and obj[0].get("text") == MARKER:
            counts["raw part lists"] += 1
        elif kind is Request and ("_body" in obj.__dict__ or "_json" in obj.__dict__):
            counts["cached bodies"] += 1
    return counts


@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
def test_a_generating_request_holds_no_parsed_body(server, stream):
    """While the engine holds the request, neither its parsed messages (pydantic objects), nor its raw
    JSON, nor its body bytes are alive: only its token ids are."""
    engine = server.state.engine
    release = threading.Event()
    real = engine.engine.runner.forward

    def held(inputs):
        release.wait(60)
        return real(inputs)

    engine.engine.runner.forward = held
    raw = json.dumps(parts_body(p.MAX_TOTAL_CONTENT_PARTS, 2, first=MARKER, stream=stream)).encode()
    answers: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answers.append(post_raw(server, CHAT, raw)))
    try:
        sender.start()
        wait_until(lambda: engine.num_in_flight == 1, what="the request reached the engine")
        counts = live_request_objects()
    finally:
        release.set()
        sender.join(60)
        engine.engine.runner.forward = real
    assert answers and answers[0].status_code == 200
    assert counts == {"parsed parts": 0, "raw part lists": 0, "cached bodies": 0}


def test_streamed_logprobs_are_detokenized_off_the_event_loop(server):
    tokenizer = server.state.engine.info.tokenizer
    calls: list[bool] = []  # per decode: whether the event loop's thread ran it
    real = tokenizer.decode

    def decode(ids, *args, **kwargs):
        calls.append(threading.current_thread() is server.thread)
        return real(ids, *args, **kwargs)

    tokenizer.decode = decode
    try:
        for path, body in ((CHAT, {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                   "top_logprobs": 3}),
                           (COMPLETIONS, {"prompt": "hello there", "logprobs": 3})):
            body = {**body, "max_tokens": 12, "ignore_eos": True, "temperature": 0}
            whole = httpx.post(server.url + path, json=body, timeout=60).json()["choices"][0]
            with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            chunks = [e["choices"][0] for e in events if e["choices"]]
            # The events in order: their texts and their logprobs' tokens make up the whole answer.
            if path == CHAT:
                text = "".join(c["delta"].get("content", "") for c in chunks)
                tokens = [t["token"] for c in chunks if c["logprobs"] for t in c["logprobs"]["content"]]
                assert text == whole["message"]["content"]
                assert tokens == [t["token"] for t in whole["logprobs"]["content"]]
            else:
                text = "".join(c["text"] for c in chunks)
                tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
                assert text == whole["text"] and tokens == whole["logprobs"]["tokens"]
                offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
                assert offsets == whole["logprobs"]["text_offset"]
            assert len(tokens) == 12
    finally:
        del tokenizer.decode  # the class's method again
    assert calls and not any(calls), "a logprob was detokenized on the event loop's thread"


def test_echo_still_has_the_prompt_text(server):
    """A prompt keeps its text only when echo asks for it."""
    body = {"prompt": "hello there", "max_tokens": 3, "ignore_eos": True, "temperature": 0}
    plain = httpx.post(server.url + COMPLETIONS, json=body, timeout=60).json()["choices"][0]["text"]
    echoed = httpx.post(server.url + COMPLETIONS, json={**body, "echo": True}, timeout=60).json()
    assert echoed["choices"][0]["text"] == "hello there" + plain
    with httpx.stream("POST", server.url + COMPLETIONS, json={**body, "echo": True, "stream": True},
                      timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == "hello there" + plain
