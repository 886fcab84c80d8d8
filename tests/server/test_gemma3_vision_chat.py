"""Chats with images on a tiny random Gemma 3 (tests/model/test_gemma3_vision.py checks its arithmetic against
transformers): the server's answer is the engine's on the same ids and embeddings, streamed alike, counted
by /tokenize; image chats and text chats run side by side in one batch."""

from __future__ import annotations

import base64
import concurrent.futures
import json

import httpx
import pytest
from in_process_server import InProcessServer, make_state
from random_images import png_bytes

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

Image = pytest.importorskip("PIL.Image")
CHAT = "/v1/chat/completions"
NAME = "tiny-gemma3-vision"


def chat(*images: bytes, text: str = "What is in the picture?", **fields) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(d).decode()}}
             for d in images]
    return {"model": NAME, "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
            "max_tokens": 6, "temperature": 0, **fields}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tiny_models import make_tiny_gemma3_vision_model

    model_dir = make_tiny_gemma3_vision_model(tmp_path_factory.mktemp("models") / NAME)
    running = InProcessServer(make_state(model_dir, served_model_name=NAME, max_model_len=512))
    yield running
    running.stop()


def engine_answer(server, images: list[bytes], text: str) -> tuple[str, int]:
    """The same chat built and run through a second engine over the served model: its text and prompt length."""
    engine = server.state.engine.engine
    tokenizer, vision = engine.tokenizer, engine.vision
    processed = [vision.processor.process(d) for d in images]
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    _, ids = tokenizer.encode_chat([{"role": "user", "content": content}])
    ids = vision.processor.place(ids, processed, tokenizer)
    local = LLMEngine(EngineConfig(model=str(engine.model.path), max_model_len=512, kv_cache_memory_gib=0.01,
                                   quantization=engine.model.quantization), loaded=engine.model)
    local.add_request("r", ids, SamplingParams(max_tokens=6, temperature=0), images=vision.encode(processed))
    tokens = []
    while local.has_unfinished():
        tokens += [t for d in local.step() for t in d.token_ids]
    return tokenizer.decode(tokens), len(ids)


def test_an_image_chat_answers_as_the_engine_does_streamed_or_not(server):
    a, b = png_bytes(50, 70, seed=1), png_bytes(90, 40, seed=2)
    body = chat(a, b, text="Compare them.")
    whole = httpx.post(server.url + CHAT, json=body, timeout=60).json()
    text, num_prompt = engine_answer(server, [a, b], "Compare them.")
    assert whole["usage"]["prompt_tokens"] == num_prompt  # 2 x 16 image tokens and their frames counted
    assert whole["choices"][0]["message"]["content"] == text
    pieces = []
    with httpx.stream("POST", server.url + CHAT, json={**body, "stream": True}, timeout=60) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                pieces += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
    assert "".join(pieces) == text
    counted = httpx.post(server.url + "/tokenize", json={"model": NAME, "messages": body["messages"]}).json()
    assert counted["count"] == num_prompt


def test_image_and_text_chats_run_side_by_side(server):
    bodies = [chat(png_bytes(60, 60, seed=k), text=f"Describe picture {k}.") for k in range(3)]
    bodies += [{"model": NAME, "messages": [{"role": "user", "content": f"Say {k}."}], "max_tokens": 6}
               for k in range(3)]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(lambda body: httpx.post(server.url + CHAT, json=body, timeout=120), bodies))
    assert [r.status_code for r in replies] == [200] * len(bodies)
    assert all(r.json()["usage"]["completion_tokens"] >= 1 for r in replies)
    # The engine is whole afterwards: a chat alone still answers as the engine does.
    data = png_bytes(50, 70, seed=1)
    reply = httpx.post(server.url + CHAT, json=chat(data), timeout=60).json()
    assert reply["choices"][0]["message"]["content"] == engine_answer(server, [data], "What is in the picture?")[0]
