"""Gemma 4's chat markup through the server, on a tiny random Gemma 4 whose tokenizer holds Gemma's control tokens
as special tokens (as its Hugging Face tokenizer does): the thinking channel <|channel>thought ... <channel|>
read as `reasoning_content`, calls in Gemma's notation <|tool_call>call:NAME{...}<tool_call|> read as OpenAI
tool calls, whole and streamed, forced calls written in that notation, and what is refused. The replies are forced by grammars naming the markers as
their single tokens (`<[id]>`), as the model writes them."""

from __future__ import annotations

import functools
import json

import httpx
import pytest
from in_process_server import InProcessServer, chat_completion, chat_events, make_state

from model.tokenizer import Tokenizer
from server.reasoning import ReasoningFormat

NAME = "gemma4-chat"
# Token ids of the tiny model's added tokens (tests/support/tiny_models.py GEMMA4_CHAT_TOKENS, from 49,152).
TURN, TURN_END, CHANNEL, CHANNEL_END, CALL, CALL_END, RESPONSE, RESPONSE_END, QUOTE = range(49152, 49161)
THOUGHT_THEN_WORD = (f'start: <[{CHANNEL}]> "thought\\n" /[a-z]{{2,6}}( [a-z]{{2,6}}){{1,3}}/ <[{CHANNEL_END}]> '
                     '/[A-Z][a-z]{1,8}/')
WEATHER_CALL = (f'start: <[{CALL}]> "call:get_weather{{city:" <[{QUOTE}]> "Paris, France" <[{QUOTE}]> ",days:3}}" '
                f'<[{CALL_END}]>')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_models import make_tiny_gemma4_chat_model

    return make_tiny_gemma4_chat_model(tmp_path_factory.mktemp("models") / "tiny-gemma4")


@pytest.fixture(scope="module")
def server(model_dir):
    server = InProcessServer(make_state(model_dir, served_model_name=NAME, max_model_len=512))
    yield server
    server.stop()


chat = functools.partial(chat_completion, model=NAME)
stream = functools.partial(chat_events, model=NAME)


def test_the_markers_a_reply_is_read_by_stay_in_its_text(model_dir):
    tokenizer = Tokenizer.from_hf_dir(model_dir)
    assert tokenizer.decode([TURN, CHANNEL, CALL, QUOTE, CALL_END, CHANNEL_END, TURN_END]) == \
        '<|channel><|tool_call><|"|><tool_call|><channel|>'  # the turn markers stay special: dropped
    assert TURN_END in tokenizer.stop_token_ids
    assert ReasoningFormat.find(tokenizer) == ReasoningFormat("<|channel>", "<channel|>", CHANNEL, CHANNEL_END,
                                                              "thought")


def test_the_thinking_channel_is_reasoning_and_the_rest_content(server):
    reply = chat(server, guided_grammar=THOUGHT_THEN_WORD, logprobs=True).json()
    message = reply["choices"][0]["message"]
    tokens = [entry["token"] for entry in reply["choices"][0]["logprobs"]["content"]]
    assert tokens[0] == "<|channel>" and "<channel|>" in tokens
    assert message["reasoning_content"] and message["reasoning_content"].islower()  # "thought" is not in it
    assert not message["reasoning_content"].startswith("thought")
    assert message["content"][0].isupper() and "<" not in message["content"]
    assert "".join(tokens) == f"<|channel>thought\n{message['reasoning_content']}<channel|>{message['content']}"
    events = stream(server, guided_grammar=THOUGHT_THEN_WORD)
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]


def test_a_call_in_gemmas_notation_is_an_openai_tool_call(server):
    reply = chat(server, tools=TOOLS, guided_grammar=WEATHER_CALL).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris, France", "days": 3}
    events = stream(server, tools=TOOLS, guided_grammar=WEATHER_CALL)
    calls = [call for e in events for c in e["choices"] for call in c["delta"].get("tool_calls", ())]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris, France", "days": 3})]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_conversation_with_calls_and_results_renders_through_the_template(server):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    reply = httpx.post(server.url + "/tokenize", json={"model": NAME, "messages": messages, "tools": TOOLS},
                       timeout=60).json()
    tokens = reply["tokens"]
    assert CALL in tokens and RESPONSE in tokens and tokens.count(TURN) == 4  # system (tools), user, model, model


# A forced call's arguments: an enum and a boolean, so that even a random model's call ends within max_tokens.
SETTINGS = {"type": "function", "function": {"name": "set_units", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "hourly": {"type": "boolean"}},
    "required": ["hourly", "unit"]}}}


def test_a_forced_call_is_written_in_gemmas_notation_and_follows_the_schema(server):
    clock = {"type": "function", "function": {"name": "get_time"}}  # no parameters: "{}"
    for choice in ("required", {"type": "function", "function": {"name": "set_units"}}):
        reply = chat(server, tools=[clock, SETTINGS], tool_choice=choice, logprobs=True).json()
        choice_ = reply["choices"][0]
        assert choice_["finish_reason"] == "tool_calls", reply
        text = "".join(entry["token"] for entry in choice_["logprobs"]["content"])
        # The turn's end closes a reply that may hold more calls; a single call's grammar ends with the call.
        assert text.startswith("<|tool_call>call:") and text.removesuffix("<turn|>").endswith("<tool_call|>")
        calls = choice_["message"]["tool_calls"]
        assert len(calls) == text.count("<|tool_call>") and (len(calls) == 1 or choice == "required")  # parallel
        for call in calls:
            arguments = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "get_time":
                assert choice == "required" and arguments == {}
            else:
                assert call["function"]["name"] == "set_units"
                assert arguments["unit"] in ("celsius", "fahrenheit") and isinstance(arguments["hourly"], bool)
    events = stream(server, tools=[clock, SETTINGS], tool_choice={"type": "function",
                                                                  "function": {"name": "set_units"}})
    calls = [c for e in events for ch in e["choices"] for c in ch["delta"].get("tool_calls", ())]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("set_units", arguments)]  # the same call as the whole reply's (greedy)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_forced_call_takes_the_markers_as_the_model_writes_them(model_dir):
    """The model writes <|tool_call> and <|"|> as single tokens: the grammar's literals allow those tokens."""
    import llguidance

    from engine.guide import Guide, GuideCompiler
    from server.tool_calls import ToolFormat, tool_call_grammar

    tokenizer = Tokenizer.from_hf_dir(model_dir)
    grammar = tool_call_grammar([SETTINGS], None, False, ToolFormat.GEMMA4)
    matcher = GuideCompiler(tokenizer, tokenizer.vocab_size).compile(Guide("lark", grammar)).matcher()
    ids = tokenizer.encode('<|tool_call>call:set_units{hourly:true,unit:<|"|>celsius<|"|>}<tool_call|>',
                           add_special_tokens=False)
    assert ids.count(QUOTE) == 2 and ids[0] == CALL and ids[-1] == CALL_END
    for token in ids:
        assert matcher.consume_token(token), tokenizer.decode([token])
    assert matcher.is_accepting()
    assert isinstance(matcher, llguidance.LLMatcher)


def test_a_strict_tool_whose_schema_the_notation_cannot_enforce_is_refused_in_one_line(server):
    strict = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "minLength": 2}}}}}
    response = chat(server, tools=[strict], tool_choice="required")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tool_choice" and "'minLength'" in error["message"] and "\n" not in error["message"]
