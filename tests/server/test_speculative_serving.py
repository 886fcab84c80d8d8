"""Speculative decoding over HTTP: the server default (--speculative-tokens) and the request's
`speculative_tokens` give the same greedy text as none, streamed events carry the several tokens a step
may yield, the counts reach /metrics, and a bad `speculative_tokens` is a 400 that names it."""

from __future__ import annotations

import json

import httpx
import pytest
from in_process_server import InProcessServer

from engine import EngineConfig, LLMEngine
from engine.async_engine import AsyncLLMEngine
from server.app import ServerSettings, ServerState

# Token ids that repeat: the random model's continuation loops, so prompt lookup finds drafts.
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12] * 6


@pytest.fixture(scope="module")
def server(tiny_dir):
    state = ServerState(ServerSettings())
    engine = LLMEngine(EngineConfig(model=str(tiny_dir), kv_cache_memory_gib=0.01, max_model_len=256,
                                    max_num_seqs=4, speculative_tokens=4))
    state.attach(AsyncLLMEngine(engine))
    running = InProcessServer(state)
    yield running
    running.stop()


def complete(url: str, **extra) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_greedy_text_is_the_same_with_and_without_speculation(server):
    off = complete(server.url, speculative_tokens=0).json()["choices"][0]["text"]
    default = complete(server.url).json()["choices"][0]["text"]
    asked = complete(server.url, speculative_tokens=16).json()["choices"][0]["text"]
    assert off == default == asked
    engine = server.state.engine.engine
    assert engine.stats.num_accepted_tokens > 0


def test_streamed_text_equals_the_whole_and_usage_counts_every_token(server):
    whole = complete(server.url).json()
    text = ""
    usage = None
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            text += "".join(choice["text"] for choice in event["choices"])
            usage = event.get("usage") or usage
    assert text == whole["choices"][0]["text"]
    assert usage["completion_tokens"] == whole["usage"]["completion_tokens"] == 40


def test_metrics_count_drafts_and_acceptance(server):
    complete(server.url)
    metrics = httpx.get(f"{server.url}/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("ladder_spec_decode")}
    assert values["ladder_spec_decode_draft_tokens_total"] >= values["ladder_spec_decode_accepted_tokens_total"] > 0
    assert 0 < values["ladder_spec_decode_acceptance_ratio"] <= 1


@pytest.mark.parametrize("value", [17, -1, 1.5, "4", True])
def test_a_bad_speculative_tokens_is_refused(server, value):
    response = complete(server.url, speculative_tokens=value)
    assert response.status_code == 400
    assert "speculative_tokens" in response.json()["error"]["message"]
    assert complete(server.url, max_tokens=2).status_code == 200  # and the server serves on
