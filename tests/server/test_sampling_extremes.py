"""The requests that killed the engine, on the real default model as `ladder serve` runs it: every value
the schema accepts is answered, and nobody else's request notices."""

from __future__ import annotations

import httpx
import pytest

from server_process import API_KEY as KEY

pytestmark = pytest.mark.slow
HEADERS = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The capital of France is"


def complete(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", headers=HEADERS, timeout=120,
                      json={"prompt": PROMPT, "max_tokens": 4, **body})


def test_repetition_penalty_that_is_zero_in_float32_no_longer_kills_the_engine(ladder_server):
    for _ in range(4):  # three used to end the engine
        response = complete(ladder_server, top_p=0.9, repetition_penalty=1e-300)
        assert response.status_code == 200, response.text
    assert httpx.get(ladder_server.url + "/health").status_code == 200
    assert complete(ladder_server, temperature=0).json()["choices"][0]["text"].startswith(" Paris")


def test_a_nucleus_too_small_for_any_token_keeps_the_most_likely(ladder_server):
    greedy = complete(ladder_server, temperature=0).json()["choices"][0]["text"]
    for top_p in (1e-50, 5e-324):
        response = complete(ladder_server, top_p=top_p, temperature=2.0)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == greedy


def test_every_extreme_value_together_with_logprobs_and_n(ladder_server):
    body = {"temperature": 2.0, "top_p": 5e-324, "top_k": 2**62, "min_p": 1.0, "presence_penalty": -2.0,
            "frequency_penalty": 2.0, "repetition_penalty": 5e-324, "seed": -(2**63), "n": 3, "logprobs": 20,
            "min_tokens": 4}
    response = complete(ladder_server, **body)
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        assert choice["finish_reason"] == "length"
        assert all(isinstance(x, float) for x in choice["logprobs"]["token_logprobs"])
