"""Chat-template control: `--chat-template` (a file or the text) replaces the model's, a request's
`chat_template_kwargs` become template variables (the server's own are refused), and a request's sampling
fields default to the model's generation_config.json (`--generation-config auto`, or `none`)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from in_process_server import InProcessServer

from engine import EngineConfig, LLMEngine
from engine.async_engine import AsyncLLMEngine
from server import protocol as p
from server.app import ServerSettings, ServerState
from server.generation import sampling_params

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if greeting is defined %}{{ greeting }}\n{% endif %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tiny_dir, tmp_path_factory):
    """The tiny chat model with a generation_config.json (greedy, top_k 5, one field out of range)."""
    directory = tmp_path_factory.mktemp("generation-config") / "model"
    shutil.copytree(tiny_dir, directory)
    (directory / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "top_k": 5, "repetition_penalty": 7.5, "do_sample": False}))
    return directory


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory_gib=0.01, max_model_len=256,
                                    max_num_seqs=4, chat_template=str(template)))
    state = ServerState(ServerSettings())
    state.attach(AsyncLLMEngine(engine))
    running = InProcessServer(state)
    yield running
    running.stop()


def chat(url: str, **extra) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def test_the_given_template_renders_the_prompt(server):
    tokenizer = server.state.engine.engine.tokenizer
    expected = tokenizer.encode("user: Hi\nassistant:", add_special_tokens=False)
    assert chat(server.url).json()["usage"]["prompt_tokens"] == len(expected)


def test_chat_template_kwargs_become_template_variables(server):
    tokenizer = server.state.engine.engine.tokenizer
    expected = tokenizer.encode("user: Hi\nHello there, friend\nassistant:", add_special_tokens=False)
    answer = chat(server.url, chat_template_kwargs={"greeting": "Hello there, friend"})
    assert answer.status_code == 200 and answer.json()["usage"]["prompt_tokens"] == len(expected)
    refused = chat(server.url, chat_template_kwargs={"messages": [], "add_generation_prompt": False})
    assert refused.status_code == 400
    assert "chat_template_kwargs cannot set add_generation_prompt, messages" in refused.json()["error"]["message"]


def test_sampling_fields_default_to_the_models_generation_config(server):
    engine = server.state.engine.engine
    # repetition_penalty 7.5 is out of range: left out (with a warning), not blamed on requests.
    assert engine.sampling_defaults == {"temperature": 0.0, "top_k": 5}
    texts = {chat(server.url).json()["choices"][0]["message"]["content"] for _ in range(3)}
    assert len(texts) == 1  # no temperature given: the model's 0, greedy
    body = p.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "temperature": 0.7})
    params = sampling_params(body, 8, None, None, engine.sampling_defaults)
    assert (params.temperature, params.top_k, params.top_p) == (0.7, 5, 1.0)  # the request's own field wins


def test_offline_generation_takes_the_same_defaults(model_dir):
    from engine.llm import LLM

    llm = LLM(str(model_dir), kv_cache_memory_gib=0.01, max_model_len=64)
    params = llm.default_sampling_params()
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0.0, 5, 1.0)
    first, again = (llm.generate(["Hello"])[0].outputs[0].token_ids for _ in range(2))
    assert first == again  # greedy, by the model's default


def test_generation_config_none_and_bad_templates(model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory_gib=0.01, max_model_len=64,
                                    generation_config="none"))
    assert engine.sampling_defaults == {}
    with pytest.raises(ValueError, match="no such file, and not a Jinja template"):
        LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory_gib=0.01, max_model_len=64,
                               chat_template="missing.jinja"))
    with pytest.raises(ValueError, match="chat template does not compile"):
        LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory_gib=0.01, max_model_len=64,
                               chat_template="{% for m in messages %}"))
    with pytest.raises(ValueError, match="generation_config is auto or none"):
        EngineConfig(model=str(model_dir), generation_config="vllm")
