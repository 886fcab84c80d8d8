"""Qwen3.5's chat through the server, on a tiny random Qwen3.5 whose vocabulary has Qwen's <think> and <tool_call>
markers and whose template writes calls in the XML notation: the reasoning block the prompt opens read as
`reasoning_content`, calls read with their arguments typed by the request's tools (whole and streamed), forced
calls in that notation, and several sequences each with its own linear-attention state. Replies are forced by
grammars naming the markers as their single tokens (`<[id]>`), as the model writes them."""

from __future__ import annotations

import functools
import json

import pytest
from in_process_server import InProcessServer, chat_completion, chat_events, make_state

NAME = "qwen3.5-chat"
THINK, END_THINK, CALL, END_CALL = range(49152, 49156)
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}]
XML_CALL = (f'<[{CALL}]> "\\n<function=get_weather>\\n<parameter=city>\\nNew York\\n</parameter>\\n<parameter=days>'
            f'\\n3\\n</parameter>\\n</function>\\n" <[{END_CALL}]>')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tiny_models import make_tiny_qwen3_5_chat_model

    directory = make_tiny_qwen3_5_chat_model(tmp_path_factory.mktemp("models") / "tiny-qwen3.5")
    server = InProcessServer(make_state(directory, served_model_name=NAME, max_model_len=512))
    yield server
    server.stop()


stream = functools.partial(chat_events, model=NAME)


def chat(server, **fields) -> dict:
    response = chat_completion(server, NAME, **fields)
    assert response.status_code == 200, response.text
    return response.json()


# The prompt opens the reply's <think> block; a guide holds from its end (here all but forced at once by the bias).
CLOSE_AT_ONCE = {str(END_THINK): 100}


def test_the_block_the_prompt_opens_is_the_reasoning(server):
    reply = chat(server, guided_grammar='start: "\\n\\n" /[A-Z][a-z]{1,8}/', logit_bias=CLOSE_AT_ONCE, max_tokens=12)
    message = reply["choices"][0]["message"]
    assert message["reasoning_content"] == "" and message["content"][0].isupper()
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == 1
    cut = chat(server, logit_bias={str(END_THINK): -100}, max_tokens=6)  # never closed: all of it reasoning
    assert cut["choices"][0]["message"]["content"] == "" and cut["choices"][0]["message"]["reasoning_content"]


def test_a_call_after_the_reasoning_has_typed_arguments_whole_and_streamed(server):
    body = {"tools": WEATHER, "guided_grammar": f'start: "\\n\\n" {XML_CALL}', "logit_bias": CLOSE_AT_ONCE,
            "max_tokens": 80}
    choice = chat(server, **body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "New York", "days": 3}
    events = stream(server, **body)
    calls = [c for e in events for ch in e["choices"] for c in ch["delta"].get("tool_calls", ())]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "New York", "days": 3}]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_forced_call_is_written_in_the_xml_notation(server):
    """tool_choice naming the function, thinking off (and no block of the reply's own: the random model might open
    one, after which a guide would hold): QWEN_XML's grammar writes the call (the random model chooses the city
    and whether to give the metric flag), which the reply reads back as a typed call."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]}, "metric": {"type": "boolean"}},
        "required": ["city"]}}}]
    for seed in range(3):
        reply = chat(server, tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                     chat_template_kwargs={"enable_thinking": False}, logit_bias={str(THINK): -100}, max_tokens=60,
                     temperature=1.0, seed=seed)
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        [call] = choice["message"]["tool_calls"]
        arguments = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] == "get_weather" and arguments["city"] in ("Paris", "Oslo")
        assert set(arguments) <= {"city", "metric"} and isinstance(arguments.get("metric", True), bool)


def test_a_past_call_and_its_result_go_back_through_the_template(server):
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    reply = chat(server, messages=messages, tools=WEATHER, max_tokens=4)
    assert reply["usage"]["prompt_tokens"] > 30


def test_samples_of_one_request_keep_their_own_states(server):
    """n = 3 greedy samples of one prompt run side by side, each in its own state slot: the same text."""
    reply = chat(server, n=3, max_tokens=12, temperature=0, chat_template_kwargs={"enable_thinking": False})
    texts = {c["message"]["content"] for c in reply["choices"]}
    assert len(texts) == 1
