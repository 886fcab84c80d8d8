"""POST /v1/embeddings (server/embeddings.py) on the tiny chat model, through the official openai client:
the vectors equal transformers' last hidden state of the last token, normalized; base64 and float agree; a
request of more inputs than run at once keeps their order; bad input is a clear 4xx."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch
from in_process_server import InProcessServer, make_state

from server.embeddings import EMBEDDING_WINDOW

KEY = "embeddings-key"
TEXTS = ["The sea at night.", "A recipe for bread: flour, water, salt and time.", "x", "猫が好き ✓"]


@pytest.fixture(scope="module")
def server(tiny_dir):
    server = InProcessServer(make_state(tiny_dir, api_key=KEY, max_model_len=64))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    import transformers

    model = transformers.AutoModel.from_pretrained(tiny_dir, torch_dtype=torch.float32).eval()

    def embed(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(hidden, dim=0)

    return embed


def test_vectors_equal_transformers_last_token(server, client, reference):
    tokenizer = server.state.engine.info.tokenizer
    out = client.embeddings.create(model="tiny-chat", input=TEXTS)
    assert [d.index for d in out.data] == list(range(len(TEXTS)))
    ids = [tokenizer.encode(text) for text in TEXTS]
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
    for data, prompt in zip(out.data, ids):
        torch.testing.assert_close(torch.tensor(data.embedding), reference(prompt), atol=2e-5, rtol=1e-4)
    # The client asked for base64 (its default); floats are the same values.
    floats = httpx.post(server.url + "/v1/embeddings", headers={"authorization": f"Bearer {KEY}"}, timeout=60,
                        json={"input": TEXTS[0], "encoding_format": "float"}).json()
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"
    assert floats["data"][0]["embedding"] == pytest.approx(out.data[0].embedding, abs=1e-6)
    raw = httpx.post(server.url + "/v1/embeddings", headers={"authorization": f"Bearer {KEY}"}, timeout=60,
                     json={"input": TEXTS[0], "encoding_format": "base64"}).json()["data"][0]["embedding"]
    assert np.frombuffer(base64.b64decode(raw), dtype="<f4").tolist() == floats["data"][0]["embedding"]


def test_token_ids_dimensions_and_many_inputs(client, reference):
    ids = [[(7 * i + j) % 300 + 20 for j in range(1 + i % 9)] for i in range(EMBEDDING_WINDOW * 2 + 5)]
    out = client.embeddings.create(model="tiny-chat", input=ids)
    assert len(out.data) == len(ids) and [d.index for d in out.data] == list(range(len(ids)))
    for i in (0, 1, EMBEDDING_WINDOW + 3, len(ids) - 1):
        torch.testing.assert_close(torch.tensor(out.data[i].embedding), reference(ids[i]), atol=2e-5, rtol=1e-4)
    short = client.embeddings.create(model="tiny-chat", input=ids[3], dimensions=8).data[0].embedding
    want = torch.nn.functional.normalize(reference(ids[3])[:8], dim=0)
    torch.testing.assert_close(torch.tensor(short), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("body,status,fragment", [
    ({"input": []}, 400, "input"),
    ({"input": ""}, 400, "input"),
    ({"input": [[]]}, 400, "input"),
    ({"input": [1] * 65}, 400, "at most 64"),
    ({"input": "word " * 80}, 400, "at most 64"),
    ({"input": [49152]}, 400, "vocabulary"),
    ({"input": "x", "dimensions": 33}, 400, "dimensions"),
    ({"input": "x", "dimensions": 0}, 400, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": ["x"] * 2049}, 400, "input"),
    ({"input": "x", "truncate_prompt_tokens": 8}, 400, "truncate_prompt_tokens"),
    ({"input": "x", "model": "gpt-9"}, 404, "gpt-9"),
])
def test_bad_input_is_a_clear_error(server, body, status, fragment):
    response = httpx.post(server.url + "/v1/embeddings", json=body, headers={"authorization": f"Bearer {KEY}"},
                          timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert fragment in error["message"] or fragment == error["param"], error


def test_the_route_needs_the_key(server):
    assert httpx.post(server.url + "/v1/embeddings", json={"input": "x"}, timeout=60).status_code == 401
