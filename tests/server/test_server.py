"""End to end: a real `ladder serve` on the default model, driven by the official openai client."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest


from server_process import API_KEY as KEY

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(ladder_server):
    return ladder_server


@pytest.fixture(scope="module")
def tokenizer():
    from model.default import default_model_path
    from model.gguf_checkpoint import GGUFCheckpoint
    from model.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(GGUFCheckpoint(default_model_path()).metadata, "default")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]


def test_chat_answers_with_exact_usage(client, tokenizer):
    out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=20,
                                         temperature=0)
    # The content is not asserted: the model's first token for this chat question is a near tie (0.08
    # logits in fp32), which the default W8A8 flips. The clear case (2.5 logits) is checked by completion.
    assert out.choices[0].message.content.strip()
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens <= 20
    completion = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is",
                                           max_tokens=4, temperature=0)
    assert completion.choices[0].text.startswith(" Paris")
    prompt = tokenizer.encode(tokenizer.apply_chat_template(CHAT), add_special_tokens=False)
    assert out.usage.prompt_tokens == len(prompt)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_completion_length_and_usage(client, tokenizer):
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The three primary colors are",
                                    max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12
    assert out.usage.prompt_tokens == len(tokenizer.encode("The three primary colors are"))


def test_streaming_equals_non_streaming(client):
    kwargs = dict(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=16, temperature=0)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    ctext = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=10,
                                      temperature=0)
    cstream = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=10,
                                        temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in cstream) == ctext.choices[0].text


def test_n_stop_logprobs_and_seed(client):
    many = client.completions.create(model="SmolLM2-135M-Instruct", prompt="A fun fact:", max_tokens=8, n=2,
                                     temperature=1.0, seed=5)
    assert sorted(c.index for c in many.choices) == [0, 1]
    again = client.completions.create(model="SmolLM2-135M-Instruct", prompt="A fun fact:", max_tokens=8, n=2,
                                      temperature=1.0, seed=5)
    assert [c.text for c in many.choices] == [c.text for c in again.choices]
    counted = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=40, temperature=0,
                                             messages=[{"role": "user", "content": "Count from 1 to 10."}])
    text = counted.choices[0].message.content
    assert "4" in text
    stopped = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=40, temperature=0,
                                             messages=[{"role": "user", "content": "Count from 1 to 10."}], stop=["4"])
    assert stopped.choices[0].message.content == text[: text.index("4")]
    assert stopped.choices[0].finish_reason == "stop"
    lp = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=5, temperature=0,
                                   logprobs=3, extra_body={"ignore_eos": True})
    assert len(lp.choices[0].logprobs.tokens) == 5
    assert all(len(top) == 3 for top in lp.choices[0].logprobs.top_logprobs)
    assert "".join(lp.choices[0].logprobs.tokens) == lp.choices[0].text
    clp = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=2)
    content = clp.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)


def test_echo_with_logprobs_scores_the_prompt(client, tokenizer):
    """lm-evaluation-harness's loglikelihood request (echo, logprobs, one token out, the prompt as ids): the
    prompt's tokens come back first, the first without a log-probability, each later one with its own and
    its best alternatives; the same in the stream, and in a request that asks for two prompts."""
    context, continuation = tokenizer.encode("The capital of France is"), tokenizer.encode(" Paris")
    ids = context + continuation
    kwargs = dict(model="SmolLM2-135M-Instruct", max_tokens=1, temperature=0, logprobs=2, echo=True)
    out = client.completions.create(prompt=ids, **kwargs)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 and "".join(lp.tokens) == out.choices[0].text
    assert out.choices[0].text.startswith("The capital of France is Paris")
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(top) == 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    paris = lp.token_logprobs[len(context):-1]  # what the harness sums: the continuation's tokens
    assert len(paris) == len(continuation) and sum(paris) > -3  # " Paris" after this context is likely
    assert lp.top_logprobs[len(context)][" Paris"] == lp.token_logprobs[len(context)]  # and the greedy choice
    streamed = list(client.completions.create(prompt=ids, stream=True, **kwargs))
    merged = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert merged == lp.token_logprobs and "".join(c.choices[0].text for c in streamed) == out.choices[0].text
    both = client.completions.create(prompt=[ids, context], **kwargs)
    assert both.choices[0].logprobs.token_logprobs == lp.token_logprobs
    assert both.choices[1].logprobs.token_logprobs[:len(context)] == lp.token_logprobs[:len(context)]
    # max_tokens 0: the prompt alone, scored (OpenAI's legacy form); without echo it is refused.
    alone = client.completions.create(prompt=ids, **{**kwargs, "max_tokens": 0})
    assert alone.choices[0].text == "The capital of France is Paris" and alone.choices[0].finish_reason == "length"
    assert alone.choices[0].logprobs.token_logprobs == lp.token_logprobs[:-1] and alone.usage.completion_tokens == 0
    streamed = list(client.completions.create(prompt=ids, stream=True, **{**kwargs, "max_tokens": 0}))
    assert "".join(c.choices[0].text for c in streamed) == alone.choices[0].text
    assert [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs] == \
        alone.choices[0].logprobs.token_logprobs
    with pytest.raises(openai.BadRequestError, match="max_tokens 0 returns nothing without echo"):
        client.completions.create(prompt=ids, **{**kwargs, "max_tokens": 0, "echo": False})


def test_vllms_prompt_logprobs_on_both_endpoints(client, tokenizer):
    """vLLM's `prompt_logprobs`: per prompt token (None for the first) the token's own log-probability and
    rank and the k best, the same values echo with logprobs gives; on chat, of the templated prompt."""
    ids = tokenizer.encode("The capital of France is Paris")
    kwargs = dict(model="SmolLM2-135M-Instruct", max_tokens=1, temperature=0)
    out = client.completions.create(prompt=ids, logprobs=1, echo=True, extra_body={"prompt_logprobs": 2}, **kwargs)
    scored = out.choices[0].prompt_logprobs
    echoed = out.choices[0].logprobs.token_logprobs
    assert len(scored) == len(ids) and scored[0] is None
    for position, entry in enumerate(scored[1:], start=1):
        own = entry[str(ids[position])]
        assert own["logprob"] == echoed[position] and own["decoded_token"] == tokenizer.decode([ids[position]])
        assert sorted(e["rank"] for e in entry.values())[:2] == [1, 2]  # the 2 best are there
        assert (own["rank"] == 1) == (own["logprob"] >= max(e["logprob"] for e in entry.values()))
    assert len(out.choices[0].logprobs.top_logprobs[1]) == 1  # echo keeps its own logprobs=1
    streamed = list(client.completions.create(prompt=ids, stream=True, extra_body={"prompt_logprobs": 2}, **kwargs))
    assert streamed[0].choices[0].prompt_logprobs == scored
    chat = client.chat.completions.create(messages=CHAT, extra_body={"prompt_logprobs": 0}, **kwargs)
    assert len(chat.prompt_logprobs) == chat.usage.prompt_tokens and chat.prompt_logprobs[0] is None
    assert all(len(entry) == 1 for entry in chat.prompt_logprobs[1:])  # k 0: each token's own entry alone


def test_32_concurrent_streams(server):
    async def one(client, i):
        stream = await client.completions.create(model="SmolLM2-135M-Instruct", prompt=f"Story number {i}:",
                                                 max_tokens=8, temperature=0.7, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        usage = None
        pieces = 0
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            pieces += bool(chunk.choices)
        return usage, pieces

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(main())
    assert all(usage.completion_tokens == 8 for usage, _ in results)
    assert all(pieces >= 1 for _, pieces in results)


def post(server, path, body, key=KEY, raw=None, headers=None):
    h = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {}),
         **(headers or {})}
    return httpx.post(server.url + path, content=raw if raw is not None else json.dumps(body), headers=h,
                      timeout=30)


@pytest.mark.parametrize("path,body,fragment", [
    ("/v1/completions", {"prompt": "x", "temperature": 3}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 100}, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [999999]}, "vocabulary"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 30,
                              "logprobs": True}, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
])
def test_invalid_fields_get_400(server, path, body, fragment):
    response = post(server, path, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert fragment in error["message"] or fragment == error["param"]


def test_context_overflow_names_both_numbers(server):
    response = post(server, "/v1/completions", {"prompt": "hello there", "max_tokens": 5000})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "1024" in message and "5000" in message and response.json()["error"]["code"] == "context_length_exceeded"


def test_malformed_json_does_not_leak_paths(server):
    response = post(server, "/v1/completions", None, raw=b'{"prompt": "x",')
    assert response.status_code == 400
    assert "/work" not in response.text and "site-packages" not in response.text


def test_auth_model_size_and_open_endpoints(server):
    assert post(server, "/v1/completions", {"prompt": "x"}, key=None).status_code == 401
    wrong = post(server, "/v1/completions", {"prompt": "x"}, key="nope")
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    missing = post(server, "/v1/completions", {"prompt": "x", "model": "gpt-9"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    big = post(server, "/v1/completions", {"prompt": "x" * 100_000})
    assert big.status_code == 413
    for path in ("/health", "/ready"):
        assert httpx.get(server.url + path, timeout=10).status_code == 200
    # With a key, the metrics need it too (by default): they count prefix-cache hits exactly.
    for path in ("/metrics", "/stats"):
        assert httpx.get(server.url + path, timeout=10).status_code == 401
        assert httpx.get(server.url + path, headers={"authorization": f"Bearer {KEY}"}, timeout=10).status_code == 200


def test_disconnect_frees_blocks(server):
    before = server.metrics()
    with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                      headers={"authorization": f"Bearer {KEY}"},
                      json={"prompt": "Tell me a very long story.", "max_tokens": 900, "stream": True,
                            "ignore_eos": True}) as response:
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = server.metrics()
        aborted = m['ladder_requests_finished_total{reason="abort"}'] - before['ladder_requests_finished_total{reason="abort"}']
        if aborted >= 1 and m["ladder_kv_cache_free_blocks"] == m["ladder_kv_cache_blocks"]:
            break
        time.sleep(0.2)
    assert aborted >= 1
    assert m["ladder_kv_cache_free_blocks"] == m["ladder_kv_cache_blocks"]
    # Non-streaming too: the client gives up, the server aborts.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", headers={"authorization": f"Bearer {KEY}"}, timeout=1.5,
                   json={"prompt": "Another long story.", "max_tokens": 900, "ignore_eos": True})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = server.metrics()
        if m['ladder_requests_finished_total{reason="abort"}'] >= before['ladder_requests_finished_total{reason="abort"}'] + 2:
            break
        time.sleep(0.2)
    assert m['ladder_requests_finished_total{reason="abort"}'] >= before['ladder_requests_finished_total{reason="abort"}'] + 2
    assert m["ladder_kv_cache_free_blocks"] == m["ladder_kv_cache_blocks"]
