"""A reasoning model's <think> block split from its answer (server/reasoning.py): the split itself (cases,
and a stream in any pieces equal to the whole), then the server on a tiny model whose vocabulary has the
markers: `message.reasoning_content` and `delta.reasoning_content`, the reasoning's tokens counted exactly,
a block the prompt opened, tool calls read after the reasoning, `include_reasoning`, past reasoning given
back to the template, the Responses API's reasoning items, and a model without markers left as it was.

The random model's text is forced by a grammar so the reply has a known shape, its markers as their single
tokens (named in the grammar, as `<[id]>`), as a reasoning model writes them."""

from __future__ import annotations

import itertools
import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from in_process_server import InProcessServer, make_state

from engine.request import Request
from engine.sampling_params import SamplingParams, ThinkBlock
from model.tokenizer import Tokenizer
from server.reasoning import Reasoning, ReasoningFormat
from server.responses import input_messages

FMT = ReasoningFormat("<think>", "</think>", 1, 2)
NAME = "thinker"


@pytest.mark.parametrize("text, opened, reasoning, content", [
    ("<think>\nLet me see.\n</think>\n\nBlue.", False, "Let me see.", "Blue."),
    ("Blue.", False, None, "Blue."),
    ("\nLet me see.\n\n</think>\n\nBlue.", True, "Let me see.", "Blue."),
    ("<think>\nstill thinking\n\n", False, "still thinking", ""),  # never closed: all reasoning
    ("<think></think>Blue.", False, "", "Blue."),
    (" <think>x</think>y", False, None, " <think>x</think>y"),  # a block starts the reply or is none
    ("<thi", False, None, "<thi"),
    ("<think>a</thin", False, "a</thin", ""),
    ("<think>a\n\nb</think>  \n  c </think> d", False, "a\n\nb", "c </think> d"),
    ("", True, "", ""),
])
def test_the_split_of_a_whole_reply(text, opened, reasoning, content):
    assert Reasoning(FMT, opened).whole(text) == (reasoning, content)


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "<th", "ink>", "\n", "\n\n", " ", "a",
                                        "bc", "</think", "think>"]), max_size=14),
       cuts=st.lists(st.integers(0, 200), max_size=8), opened=st.booleans())
def test_a_stream_in_any_pieces_splits_as_the_whole(pieces, cuts, opened):
    assert_stream_splits_as_the_whole(FMT, "".join(pieces), cuts, opened)


def assert_stream_splits_as_the_whole(fmt: ReasoningFormat, text: str, cuts: list[int], opened: bool) -> None:
    """`text` pushed in pieces cut at `cuts` (taken modulo its length) splits as the whole text does."""
    whole_reasoning, whole_content = Reasoning(fmt, opened).whole(text)
    split = Reasoning(fmt, opened).split()
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    streamed = [split.push(text[a:b]) for a, b in itertools.pairwise(bounds)] + [split.finish()]
    assert "".join(r for r, _ in streamed) == (whole_reasoning or "")
    assert "".join(c for _, c in streamed) == whole_content


GEMMA4 = ReasoningFormat("<|channel>", "<channel|>", 1, 2, "thought")


@pytest.mark.parametrize("text, reasoning, content", [
    ("<|channel>thought\nLet me see.<channel|>Blue.", "Let me see.", "Blue."),
    ("<|channel>thought\n<channel|>Blue.", "", "Blue."),  # thinking off: an empty block
    ("<|channel>thoughtful words<channel|>x", "ful words", "x"),  # the name, then what follows it
    ("<|channel>though", "though", ""),  # cut inside the name: never closed, so all reasoning
    ("<|channel>other\nx<channel|>y", "other\nx", "y"),  # not the name: kept
])
def test_gemma4s_channel_loses_its_name(text, reasoning, content):
    assert Reasoning(GEMMA4, False).whole(text) == (reasoning, content)


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(["<|channel>", "<channel|>", "thought", "th", "ought", "\n", " ", "a",
                                        "<|chan", "nel>", "<channel"]), max_size=14),
       cuts=st.lists(st.integers(0, 200), max_size=8), opened=st.booleans())
def test_a_gemma4_stream_in_any_pieces_splits_as_the_whole(pieces, cuts, opened):
    assert_stream_splits_as_the_whole(GEMMA4, "".join(pieces), cuts, opened)


def test_the_engine_counts_reasoning_tokens_from_the_start_marker_to_the_end_marker():
    """Request.note_reasoning: the block's tokens of the output, markers counted (usage's), and the tokens
    inside it (the budget's)."""
    def count(ids: list[int], opened: bool) -> tuple[int, int, bool | None]:
        request = Request("r", [5], SamplingParams(reasoning=ThinkBlock(1, 2, opened)))
        for token in ids:
            request.note_reasoning(token)
        return request.num_reasoning_output_tokens, request.num_reasoning_tokens, request.in_reasoning

    assert count([1, 7, 8, 2, 9], False) == (4, 2, False)
    assert count([7, 8, 2, 9], True) == (3, 2, False)
    assert count([7, 1, 8, 2], False) == (0, 0, False)  # no block: it does not start the reply
    assert count([1, 7, 8], False) == (3, 2, True)  # never closed
    assert count([], False) == (0, 0, None)  # the first token will say
    assert FMT.opened_by([5, 1, 9]) and not FMT.opened_by([1, 9, 2, 5]) and not FMT.opened_by([5, 6])


def test_the_markers_are_found_in_a_vocabulary_that_has_them(thinker_dir, tiny_dir):
    assert ReasoningFormat.find(Tokenizer.from_hf_dir(thinker_dir)) == ReasoningFormat("<think>", "</think>",
                                                                                       49152, 49153)
    plain = Tokenizer.from_hf_dir(tiny_dir)
    assert ReasoningFormat.find(plain) is None
    assert ReasoningFormat.for_server("auto", plain) is None
    with pytest.raises(ValueError, match="no such pair"):
        ReasoningFormat.for_server("qwen3", plain)
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningFormat.for_server("deepseek", plain)


# --- the server --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def thinker_dir(tmp_path_factory):
    from tiny_models import make_tiny_thinking_model

    return make_tiny_thinking_model(tmp_path_factory.mktemp("models") / "tiny-thinker")


@pytest.fixture(scope="module")
def server(thinker_dir):
    server = InProcessServer(make_state(thinker_dir, served_model_name=NAME, max_model_len=512))
    yield server
    server.stop()


# A reply forced to a reasoning model's shape, its markers named as tokens (`<[id]>` in llguidance's Lark), as
# such a model writes them.
THOUGHT_THEN_WORD = 'start: <[49152]> "\\n" /[a-z]{2,6}( [a-z]{2,6}){1,3}/ "\\n" <[49153]> "\\n\\n" /[A-Z][a-z]{1,8}/'


def chat(server, messages=None, **fields) -> dict:
    body = {"model": NAME, "messages": messages or [{"role": "user", "content": "Why is the sky blue?"}],
            "max_tokens": 60, "temperature": 0, **fields}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def stream(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def tokens_through_end_marker(reply: dict) -> int:
    tokens = [entry["token"] for entry in reply["choices"][0]["logprobs"]["content"]]
    return tokens.index("</think>") + 1


def test_the_reasoning_is_apart_from_the_content_and_its_tokens_counted(server):
    reply = chat(server, guided_grammar=THOUGHT_THEN_WORD, logprobs=True)
    message = reply["choices"][0]["message"]
    tokens = [entry["token"] for entry in reply["choices"][0]["logprobs"]["content"]]
    assert tokens[0] == "<think>" and "</think>" in tokens  # single tokens, as a reasoning model writes them
    assert message["reasoning_content"] and "\n" not in message["reasoning_content"]
    assert message["content"][0].isupper() and "<think>" not in message["content"]
    assert "".join(tokens) == f"<think>\n{message['reasoning_content']}\n</think>\n\n{message['content']}"
    details = reply["usage"]["completion_tokens_details"]
    assert details["reasoning_tokens"] == tokens_through_end_marker(reply) < reply["usage"]["completion_tokens"]


def test_the_stream_splits_as_the_whole_reply(server):
    body = {"model": NAME, "messages": [{"role": "user", "content": "Why?"}], "max_tokens": 60, "temperature": 0,
            "guided_grammar": THOUGHT_THEN_WORD, "n": 2, "seed": 3,
            "stream_options": {"include_usage": True}}
    whole = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
    events = stream(server, "/v1/chat/completions", body)
    for choice in whole["choices"]:
        deltas = [c["delta"] for e in events for c in e["choices"] if c["index"] == choice["index"]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == choice["message"]["reasoning_content"]
        assert "".join(d.get("content", "") for d in deltas) == choice["message"]["content"]
        # The reasoning comes first, then the content, never both in one event's order reversed.
        kinds = [k for d in deltas for k in ("reasoning_content", "content") if d.get(k)]
        assert kinds == sorted(kinds, key=lambda k: k == "content")
    assert events[-1]["usage"] == {k: v for k, v in whole["usage"].items() if v is not None}


def test_a_block_the_prompt_opened(server):
    # The guide holds after the block: its end (all but forced by the bias) comes first, then the answer.
    reply = chat(server, chat_template_kwargs={"open_thinking": True}, guided_choice=["Yes", "No"],
                 logit_bias={"49153": 100}, logprobs=True)
    message = reply["choices"][0]["message"]
    assert message["content"] in ("Yes", "No") and message["reasoning_content"] == ""
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == tokens_through_end_marker(reply) == 1
    # Cut off while thinking (its end banned): all of it is reasoning.
    cut = chat(server, chat_template_kwargs={"open_thinking": True}, logit_bias={"49153": -100}, max_tokens=5)
    assert cut["choices"][0]["finish_reason"] == "length" and cut["choices"][0]["message"]["content"] == ""
    assert cut["usage"]["completion_tokens_details"]["reasoning_tokens"] == 5


def test_a_guide_holds_after_the_reasoning(server):
    """A guide is for the answer: a block the reply opens (its first token, here all but forced by the bias)
    runs free, and the guide holds from its end; a grammar that names the start token covers the block
    itself (the tests above)."""
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    block_first = {"49152": 50, "49153": 100}  # <think> wins the first token, </think> the next
    reply = chat(server, response_format=response_format, logit_bias=block_first, logprobs=True)
    tokens = [entry["token"] for entry in reply["choices"][0]["logprobs"]["content"]]
    message = reply["choices"][0]["message"]
    assert tokens[:2] == ["<think>", "</think>"] and message["reasoning_content"] == ""
    assert json.loads(message["content"])["answer"] in ("yes", "no")
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == 2
    # Without a block the guide holds from the first token.
    plain = chat(server, response_format=response_format, logit_bias={"49152": -100})
    assert plain["choices"][0]["message"]["reasoning_content"] is None
    assert json.loads(plain["choices"][0]["message"]["content"])["answer"] in ("yes", "no")
    # A forced tool call, after the reasoning.
    zone = {"type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
            "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": zone}}]
    called = chat(server, tools=tools, tool_choice="required", logit_bias=block_first, max_tokens=80)
    assert called["choices"][0]["message"]["reasoning_content"] == ""
    call = called["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_time" and json.loads(call["arguments"])["zone"] in ("utc", "local")


def test_a_reasoning_budget_ends_the_block(server):
    never_ends = {"49153": -100}  # the model would not close its block itself
    reply = chat(server, chat_template_kwargs={"open_thinking": True}, logit_bias=never_ends, reasoning_budget=3,
                 max_tokens=10, logprobs=True)
    tokens = [entry["token"] for entry in reply["choices"][0]["logprobs"]["content"]]
    assert tokens[3] == "</think>" and "</think>" not in tokens[:3]
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == 4  # three, then the end marker
    assert reply["choices"][0]["message"]["reasoning_content"] == "".join(tokens[:3]).strip("\n")
    # A block the reply opens: its start marker, two tokens, the end.
    opened = chat(server, logit_bias={"49152": 100, **never_ends}, reasoning_budget=2, max_tokens=10, logprobs=True)
    tokens = [entry["token"] for entry in opened["choices"][0]["logprobs"]["content"]]
    assert tokens[0] == "<think>" and tokens[3] == "</think>"
    assert opened["usage"]["completion_tokens_details"]["reasoning_tokens"] == 4
    # 0: no thinking; the server's default applies to a request that gives none.
    none = chat(server, chat_template_kwargs={"open_thinking": True}, logit_bias=never_ends, reasoning_budget=0,
                max_tokens=4)
    assert none["choices"][0]["message"]["reasoning_content"] == ""
    assert none["usage"]["completion_tokens_details"]["reasoning_tokens"] == 1
    server.state.settings.reasoning_budget = 1
    try:
        default = chat(server, chat_template_kwargs={"open_thinking": True}, logit_bias=never_ends, max_tokens=6)
    finally:
        server.state.settings.reasoning_budget = None
    assert default["usage"]["completion_tokens_details"]["reasoning_tokens"] == 2
    bad = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": NAME, "messages": [{"role": "user", "content": "Hi"}], "reasoning_budget": -1})
    assert bad.status_code == 400 and "reasoning_budget" in bad.text


@pytest.fixture(scope="module")
def plain_server(thinker_dir):
    """The same model with --reasoning-parser none: its reply is content, and a guide holds from the start."""
    server = InProcessServer(make_state(thinker_dir, served_model_name=NAME, max_model_len=512,
                                        reasoning_parser="none"))
    yield server
    server.stop()


def test_a_guide_that_only_spells_a_marker_writes_its_text(plain_server):
    """llguidance takes every added token spelled <...> for a special one: its mask allowed <think> where a
    regex's text begins with "<think>", and its matcher then refused the token, a 500 for any guided request
    of a model with such tokens. The tokenizer llguidance is given now holds them as text
    (engine/guide.py `_llguidance_json`): the text is written in the tokens llguidance reads it as."""
    reply = chat(plain_server, guided_regex="<think>\n[a-z]{3,6}\n</think>\n\nOk",
                 logit_bias={"49152": 100, "49153": 100}, logprobs=True)
    tokens = [entry["token"] for entry in reply["choices"][0]["logprobs"]["content"]]
    assert "<think>" not in tokens and "</think>" not in tokens
    message = reply["choices"][0]["message"]
    assert message["content"].startswith("<think>\n") and message["content"].endswith("\n</think>\n\nOk")
    assert message["reasoning_content"] is None and reply["usage"]["completion_tokens_details"] is None


def test_a_forced_tool_call_when_the_vocabulary_has_a_tool_call_token(plain_server):
    """The same disagreement made every forced tool call of a Qwen model fail: its grammar starts with the
    text <tool_call>, which Qwen's vocabulary holds as one added token."""
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    for bias in ({}, {"49154": 100}):  # the model's preference for the token is no matter
        reply = chat(plain_server, tools=tools, tool_choice="required", logit_bias=bias, logprobs=True)
        tokens = [entry["token"] for entry in reply["choices"][0]["logprobs"]["content"]]
        assert "".join(tokens).startswith('<tool_call>\n{"name": "get_time"') and "<tool_call>" not in tokens[:5]


def test_a_reasoning_budget_needs_a_reasoning_model(plain_server):
    response = httpx.post(plain_server.url + "/v1/chat/completions", timeout=30, json={
        "model": NAME, "messages": [{"role": "user", "content": "Hi"}], "reasoning_budget": 10})
    assert response.status_code == 400 and "reasoning_budget needs a reasoning model" in response.text


def test_thinking_switched_off_leaves_the_reply_as_content(server):
    reply = chat(server, chat_template_kwargs={"enable_thinking": False}, guided_regex="[A-Z][a-z]{2,8}")
    message = reply["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"][0].isupper()
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_include_reasoning_false_leaves_it_out(server):
    why = [{"role": "user", "content": "Why?"}]
    full = chat(server, why, guided_grammar=THOUGHT_THEN_WORD)
    bare = chat(server, why, guided_grammar=THOUGHT_THEN_WORD, include_reasoning=False)
    assert bare["choices"][0]["message"]["reasoning_content"] is None
    assert bare["choices"][0]["message"]["content"] == full["choices"][0]["message"]["content"]
    events = stream(server, "/v1/chat/completions", {"model": NAME, "messages": why,
                                                     "max_tokens": 60, "temperature": 0, "include_reasoning": False,
                                                     "guided_grammar": THOUGHT_THEN_WORD})
    assert not any("reasoning_content" in c["delta"] for e in events for c in e["choices"])
    assert "".join(c["delta"].get("content", "") for e in events for c in e["choices"]) == \
        full["choices"][0]["message"]["content"]


def test_tool_calls_are_read_after_the_reasoning(server):
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    # A call written inside the reasoning is thought about, not made; the one after it is made.
    call = '"<tool_call>\\n{\\"name\\": \\"get_time\\", \\"arguments\\": {}}\\n</tool_call>"'
    grammar = f'start: <[49152]> "\\n" {call} "\\n" <[49153]> "\\n\\n" {call}'
    body = {"tools": tools, "guided_grammar": grammar, "max_tokens": 80}
    reply = chat(server, **body)
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 1
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert choice["message"]["reasoning_content"].startswith("<tool_call>")
    events = stream(server, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "Time?"}],
                                                     "temperature": 0, **body})
    calls = [call for e in events for c in e["choices"] for call in c["delta"].get("tool_calls", ())]
    assert [call["function"]["name"] for call in calls] == ["get_time"]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_past_reasoning_reaches_the_template(server):
    def count(messages) -> int:
        response = httpx.post(server.url + "/tokenize", json={"model": NAME, "messages": messages}, timeout=30)
        assert response.status_code == 200, response.text
        return response.json()["count"]

    turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"}]
    with_reasoning = [turn[0], {**turn[1], "reasoning_content": "They greet me."}, turn[2]]
    # The template writes the block: <think>, "\n", the text, "\n", </think>, "\n\n".
    thought = len(Tokenizer.from_hf_dir(server.state.engine.info.model_path).encode("They greet me.",
                                                                                   add_special_tokens=False))
    assert count(with_reasoning) >= count(turn) + thought + 3
    bad = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": NAME, "messages": [{"role": "user", "content": "Hi", "reasoning_content": "no"}]})
    assert bad.status_code == 400 and "only assistant messages carry reasoning_content" in bad.text


def test_the_responses_api_returns_a_reasoning_item(server):
    body = {"model": NAME, "input": "Why is the sky blue?", "max_output_tokens": 60, "temperature": 0,
            "guided_grammar": THOUGHT_THEN_WORD}
    chat_reply = chat(server, guided_grammar=THOUGHT_THEN_WORD)["choices"][0]["message"]
    whole = httpx.post(server.url + "/v1/responses", json=body, timeout=60).json()
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message"]
    assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": chat_reply["reasoning_content"]}]
    assert whole["output"][1]["content"][0]["text"] == chat_reply["content"]
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    events = stream(server, "/v1/responses", body)
    kinds = [e["type"] for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert thought == chat_reply["reasoning_content"]
    assert events[-1]["response"]["output"] == [{**item, "id": streamed["id"]} for item, streamed in
                                                zip(whole["output"], events[-1]["response"]["output"])]
    # The stored conversation keeps the reasoning for the next turn's template.
    stored = server.state.responses.get(whole["id"]).messages
    assert stored[-1] == {"role": "assistant", "content": chat_reply["content"],
                          "reasoning_content": chat_reply["reasoning_content"]}


def test_reasoning_items_in_input_go_with_the_next_assistant_turn():
    items = [{"role": "user", "content": "Hi"},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Greet."}]},
             {"type": "function_call", "call_id": "c1", "name": "wave", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "waved"},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "only a summary"}]},
             {"role": "assistant", "content": "Hello."}]
    messages = input_messages(items)
    assert messages[1]["reasoning_content"] == "Greet." and messages[1]["tool_calls"][0]["id"] == "c1"
    assert messages[3] == {"role": "assistant", "content": "Hello."}


def test_a_model_without_markers_is_answered_as_before(tiny_dir):
    server = InProcessServer(make_state(tiny_dir, max_model_len=256))
    try:
        reply = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}).json()
        assert reply["choices"][0]["message"]["reasoning_content"] is None
        assert reply["usage"]["completion_tokens_details"] is None
        server.state.settings.reasoning_parser = "think"
        with pytest.raises(ValueError, match="--reasoning-parser think needs"):
            server.state.attach(server.state.engine)
    finally:
        server.stop()
