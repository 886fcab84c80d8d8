"""Chats with images (server/images.py) on a tiny random SmolVLM: `image_url` content parts as data: URLs
or from an allowed host, answered as the engine answers the same ids and embeddings, streamed alike,
counted by /tokenize; and each way a request's images can be wrong refused with a 400 that says why."""

from __future__ import annotations

import http.server
import itertools
import json
import threading

import httpx
import pytest
from in_process_server import InProcessServer, make_state
from random_images import data_url, png_bytes

from engine.sampling_params import SamplingParams
from model.vision import EncodedImages
from server.images import host_allowed

Image = pytest.importorskip("PIL.Image")
CHAT = "/v1/chat/completions"
NAME = "tiny-smolvlm"


def chat(*urls: str, text: str = "What is in the picture?", **fields) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {"model": NAME, "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
            "max_tokens": 5, "temperature": 0, **fields}


@pytest.fixture(scope="module")
def image_host():
    """A local HTTP server with one image at /cat.png; /away redirects to it by the name `localhost`."""
    directory = {"/cat.png": png_bytes(80, 120, seed=7)}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/away":
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{self.server.server_port}/cat.png")
                self.end_headers()
                return
            body = directory.get(self.path)
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}", directory["/cat.png"]
    httpd.shutdown()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tiny_models import make_tiny_vision_model

    model_dir = make_tiny_vision_model(tmp_path_factory.mktemp("models") / NAME)
    running = InProcessServer(make_state(model_dir, served_model_name=NAME, max_model_len=1024,
                                         max_images_per_prompt=3, allowed_image_domains=("127.0.0.1",)))
    yield running
    running.stop()


def engine_tokens(server, data: list[bytes], text: str = "What is in the picture?") -> tuple[list[int], int]:
    """The greedy tokens and prompt length of the same chat, built and run through the engine directly."""
    engine = server.state.engine.engine
    tokenizer, vision = engine.tokenizer, engine.vision
    images = [vision.processor.process(d) for d in data]
    content = [{"type": "image"} for _ in data] + [{"type": "text", "text": text}]
    _, ids = tokenizer.encode_chat([{"role": "user", "content": content}])
    ids = vision.processor.place(ids, images, tokenizer)
    encoded: EncodedImages = vision.encode(images)
    # The engine thread owns the engine: a second engine over the same loaded model runs it here.
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    local = LLMEngine(EngineConfig(model=str(engine.model.path), max_model_len=1024, kv_cache_memory_gib=0.01,
                                   quantization=engine.model.quantization), loaded=engine.model)
    local.add_request("r", ids, SamplingParams(max_tokens=5, temperature=0), images=encoded)
    tokens = []
    while local.has_unfinished():
        tokens += [t for d in local.step() for t in d.token_ids]
    return tokens, len(ids)


def test_a_chat_with_an_image_answers_as_the_engine_does(server):
    data = png_bytes(90, 150, seed=1)
    reply = httpx.post(server.url + CHAT, json=chat(data_url(data), logprobs=True), timeout=60).json()
    tokens, num_prompt = engine_tokens(server, [data])
    assert reply["usage"]["prompt_tokens"] == num_prompt  # the image's tokens counted, as the engine saw them
    text = server.state.engine.info.tokenizer.decode(tokens)
    assert reply["choices"][0]["message"]["content"] == text
    # The image changes the answer's odds: another image, other log-probabilities.
    other = httpx.post(server.url + CHAT, json=chat(data_url(png_bytes(90, 150, seed=2)), logprobs=True), timeout=60)
    first = reply["choices"][0]["logprobs"]["content"][0]["logprob"]
    assert other.json()["choices"][0]["logprobs"]["content"][0]["logprob"] != first


def test_streamed_and_two_images_and_the_url_form(server, image_host):
    host, cat = image_host
    a, b = png_bytes(64, 64, seed=3), png_bytes(40, 200, seed=4)
    body = chat(data_url(a), data_url(b), text="Compare them.")
    whole = httpx.post(server.url + CHAT, json=body, timeout=60).json()
    tokens, num_prompt = engine_tokens(server, [a, b], text="Compare them.")
    assert whole["usage"]["prompt_tokens"] == num_prompt
    assert whole["choices"][0]["message"]["content"] == server.state.engine.info.tokenizer.decode(tokens)
    pieces = []
    with httpx.stream("POST", server.url + CHAT, json={**body, "stream": True}, timeout=60) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                pieces += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
    assert "".join(pieces) == whole["choices"][0]["message"]["content"]
    # An allowed host's URL reads as its bytes sent inline; the bare-string form of image_url too.
    fetched = httpx.post(server.url + CHAT, json=chat(host + "/cat.png"), timeout=60).json()
    inline = httpx.post(server.url + CHAT, json=chat(data_url(cat)), timeout=60).json()
    bare = chat()
    bare["messages"][0]["content"].insert(0, {"type": "image_url", "image_url": data_url(cat)})
    bare_reply = httpx.post(server.url + CHAT, json=bare, timeout=60).json()
    assert fetched["choices"][0]["message"] == inline["choices"][0]["message"] == bare_reply["choices"][0]["message"]


def test_tokenize_counts_what_the_completion_sees(server):
    data = png_bytes(90, 150, seed=1)
    body = chat(data_url(data))
    counted = httpx.post(server.url + "/tokenize", json={"model": NAME, "messages": body["messages"]}).json()
    reply = httpx.post(server.url + CHAT, json=body, timeout=60).json()
    assert counted["count"] == reply["usage"]["prompt_tokens"] == engine_tokens(server, [data])[1]


def test_text_only_chats_still_work_on_a_vision_model(server):
    reply = httpx.post(server.url + CHAT, json={"model": NAME, "messages": [{"role": "user", "content": "Hi"}],
                                                "max_tokens": 3}, timeout=60)
    assert reply.status_code == 200
    assert reply.json()["usage"]["prompt_tokens"] == len(server.state.engine.info.tokenizer.encode(
        "<|im_start|>User: Hi<end_of_utterance>\nAssistant:", add_special_tokens=False))


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64,@@@", "not valid base64"),
    ("data:image/png,abc", "data:<type>;base64,<data>"),
    (data_url(b"plain text, not pixels"), "image 1: not a readable image"),
    ("http://example.com/cat.png", "not fetched from example.com"),
    ("ftp://127.0.0.1/cat.png", "data: URL (base64) or an http(s) URL"),
    ("http://127.0.0.1:9/none.png", "could not fetch the image"),
])
def test_bad_images_are_400s(server, url, message):
    reply = httpx.post(server.url + CHAT, json=chat(url), timeout=60)
    assert reply.status_code == 400, reply.text
    assert message in reply.json()["error"]["message"]
    assert reply.json()["error"]["param"] == "messages"


def test_too_many_images_and_a_missing_one_are_400s(server, image_host):
    host, _ = image_host
    data = data_url(png_bytes(30, 30, seed=5))
    reply = httpx.post(server.url + CHAT, json=chat(data, data, data, data), timeout=60)
    assert reply.status_code == 400 and "at most 3" in reply.json()["error"]["message"]
    missing = httpx.post(server.url + CHAT, json=chat(host + "/none.png"), timeout=60)
    assert missing.status_code == 400 and "could not fetch" in missing.json()["error"]["message"]
    # An allowed host (127.0.0.1) that redirects elsewhere (localhost, not allowed) is not followed.
    away = httpx.post(server.url + CHAT, json=chat(host + "/away"), timeout=60)
    assert away.status_code == 400 and "redirected to localhost, a host not allowed" in away.json()["error"]["message"]
    # Text that spells the image token is text: it neither takes an image's place nor fails the request.
    spelled = httpx.post(server.url + CHAT, json=chat(text="<image> here"), timeout=60)
    assert spelled.status_code == 200


def test_a_model_without_vision_refuses_images(tiny_server_url):
    body = chat(data_url(png_bytes(8, 8, seed=0)))
    del body["model"]
    reply = httpx.post(tiny_server_url + CHAT, json=body, timeout=60)
    assert reply.status_code == 400 and "takes no images" in reply.json()["error"]["message"]


@pytest.fixture(scope="module")
def tiny_server_url(tiny_dir):
    running = InProcessServer(make_state(tiny_dir))
    yield running.url
    running.stop()


def test_image_hosts_match_by_name():
    allowed = ("example.com", "*.images.net")
    assert host_allowed("EXAMPLE.com", allowed) and host_allowed("a.images.net", allowed)
    assert not host_allowed("images.net", allowed) and not host_allowed("example.com.evil", allowed)
    assert host_allowed("anything", ("*",)) and not host_allowed("x", ())


def test_the_responses_api_reads_input_image_parts(server):
    data = png_bytes(90, 150, seed=1)
    chat_reply = httpx.post(server.url + CHAT, json=chat(data_url(data)), timeout=60).json()
    reply = httpx.post(server.url + "/v1/responses", json={
        "model": NAME, "max_output_tokens": 5, "temperature": 0, "store": False,
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(data)},
                                               {"type": "input_text", "text": "What is in the picture?"}]}],
    }, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["output"][0]["content"][0]["text"] == chat_reply["choices"][0]["message"]["content"]
    assert reply.json()["usage"]["input_tokens"] == chat_reply["usage"]["prompt_tokens"]
    no_url = httpx.post(server.url + "/v1/responses", json={
        "model": NAME, "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]})
    assert no_url.status_code == 400 and "file_id is not supported" in no_url.json()["error"]["message"]


def test_the_tower_runs_on_the_engine_thread_a_tile_between_steps(server, monkeypatch):
    """Not on a worker thread: a second thread running torch's parallel ops keeps an OpenMP team alive
    beside the engine's, and every later step ran 3x slower (AsyncLLMEngine.encode_images). One tile at a
    time (EngineConfig.vision_tiles_per_step), so requests running meanwhile take steps between the tiles."""
    encoder = server.state.engine.engine.vision.encoder
    calls = []
    forward = encoder.forward
    monkeypatch.setattr(encoder, "forward", lambda pixels: calls.append((threading.current_thread(),
                                                                         pixels.shape[0])) or forward(pixels))
    reply = httpx.post(server.url + CHAT, json=chat(data_url(png_bytes(64, 64, seed=9))), timeout=60)
    assert reply.status_code == 200
    assert calls == [(server.state.engine._thread, 1)] * 5  # 5 tiles (a 2 x 2 grid and the global one)


def test_a_running_stream_takes_steps_between_an_images_tiles(server, monkeypatch):
    engine = server.state.engine.engine
    events = []
    forward, step = engine.vision.encoder.forward, engine.step
    monkeypatch.setattr(engine.vision.encoder, "forward", lambda pixels: events.append("tile") or forward(pixels))
    monkeypatch.setattr(engine, "step", lambda: events.append("step") or step())
    text = {"model": NAME, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 400,
            "ignore_eos": True, "stream": True}

    def stream_text():
        with httpx.stream("POST", server.url + CHAT, json=text, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {") and not started.is_set():
                    started.set()

    started = threading.Event()
    streaming = threading.Thread(target=stream_text)
    streaming.start()
    assert started.wait(60)
    reply = httpx.post(server.url + CHAT, json=chat(data_url(png_bytes(90, 150, seed=11))), timeout=60)
    streaming.join(120)
    assert reply.status_code == 200
    tiles = [i for i, event in enumerate(events) if event == "tile"]
    assert len(tiles) == 5 and all("step" in events[a:b] for a, b in itertools.pairwise(tiles))


def test_metrics_count_the_towers_work_and_the_image_cache(server):
    def counters() -> dict[str, float]:
        text = httpx.get(server.url + "/metrics").text
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line.startswith("ladder_vision_")}

    before = counters()
    data = data_url(png_bytes(50, 70, seed=21))  # a new image: 5 tiles
    for _ in range(2):
        assert httpx.post(server.url + CHAT, json=chat(data), timeout=60).status_code == 200
    after = counters()
    assert after["ladder_vision_images_encoded_total"] - before["ladder_vision_images_encoded_total"] == 1
    assert after["ladder_vision_images_cached_total"] - before["ladder_vision_images_cached_total"] == 1
    assert after["ladder_vision_tiles_total"] - before["ladder_vision_tiles_total"] == 5
    assert after["ladder_vision_seconds_total"] > before["ladder_vision_seconds_total"]


def test_a_request_refused_for_another_reason_runs_no_tower(server, monkeypatch):
    encoder = server.state.engine.engine.vision.encoder
    calls = []
    forward = encoder.forward
    monkeypatch.setattr(encoder, "forward", lambda pixels: calls.append(pixels.shape[0]) or forward(pixels))
    bad_grammar = chat(data_url(png_bytes(40, 40, seed=31)), guided_regex="(unclosed")
    reply = httpx.post(server.url + CHAT, json=bad_grammar, timeout=60)
    assert reply.status_code == 400 and calls == []
