"""GPT-OSS's harmony replies (server/harmony.py): the split of a whole reply into reasoning, content and canonical
calls, a stream in any pieces equal to the whole, and the HARMONY tool format reading those calls."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.harmony import HarmonyReasoning
from server.tool_calls import ToolCallStream, ToolFormat, parse_tool_calls, tool_call_grammar, tool_format

ANALYSIS = "<|channel|>analysis<|message|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.weather <|constrain|>json<|message|>{"city": "Oslo"}'
CANONICAL = '<|channel|>commentary to=functions.weather<|message|>{"city": "Oslo"}<|call|>'


@pytest.mark.parametrize("prefix, text, reasoning, content", [
    ("", ANALYSIS + "Think." + FINAL + "Blue.", "Think.", "Blue."),
    ("", "<|channel|>final<|message|>Blue.", None, "Blue."),
    ("", ANALYSIS + "Think." + CALL, "Think.", CANONICAL),
    # `to=` before the channel, as the template writes past calls
    ("", '<|start|>assistant to=functions.weather<|channel|>commentary json<|message|>{"city": "Oslo"}', None,
     CANONICAL),
    ("", "Plain text, no markup.", None, "Plain text, no markup."),
    ("", ANALYSIS + "still thinking", "still thinking", ""),  # cut by the length limit
    ("", "<|channel|>commentary<|message|>Checking." + CALL, None, "Checking." + CANONICAL),
    ("", ANALYSIS + "a" + "<|start|>assistant<|channel|>analysis<|message|>b" + FINAL + "c", "ab", "c"),
    # the prompt began the header (the generation prompt)
    ("<|start|>assistant", ANALYSIS + "Think." + FINAL + "Blue.", "Think.", "Blue."),
    ("<|start|>assistant<|channel|>final<|message|>", "Blue.", None, "Blue."),
    ("", "<|chan", None, "<|chan"),
    ("", "<|channel|>analys", None, "<|channel|>analys"),  # a header never finished is text
    ("", "", None, ""),
])
def test_the_split_of_a_whole_reply(prefix, text, reasoning, content):
    assert HarmonyReasoning(prefix).whole(text) == (reasoning, content)


def test_include_false_drops_the_analysis_from_both():
    assert HarmonyReasoning("", include=False).whole(ANALYSIS + "Think." + FINAL + "Blue.") == (None, "Blue.")


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from([ANALYSIS, FINAL, CALL, "<|start|>", "<|channel|>", "<|message|>", "<|",
                                        "<|chan", "nel|>", "analysis", " to=functions.f", "a", "bc", "\n", "{}"]),
                       max_size=10),
       cuts=st.lists(st.integers(0, 400), max_size=8), prefix=st.sampled_from(["", "<|start|>assistant"]))
def test_a_stream_in_any_pieces_splits_as_the_whole(pieces, cuts, prefix):
    text = "".join(pieces)
    whole = HarmonyReasoning(prefix).whole(text)
    split = HarmonyReasoning(prefix).split()
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    streamed = [split.push(text[a:b]) for a, b in itertools.pairwise(bounds)] + [split.finish()]
    reasoning = "".join(r for r, _ in streamed)
    assert (reasoning if split.analysed else None, "".join(c for _, c in streamed)) == whole


def test_the_template_names_the_format_and_its_calls_parse():
    assert tool_format("{{ '<|start|>assistant<|channel|>final<|message|>' }}") is ToolFormat.HARMONY
    content, calls = parse_tool_calls("Checking." + CANONICAL, ToolFormat.HARMONY)
    assert content == "Checking." and [(c.name, c.arguments) for c in calls] == [("weather", '{"city": "Oslo"}')]
    content, calls = parse_tool_calls("<|channel|>commentary to=functions.weather<|message|>not json<|call|>",
                                      ToolFormat.HARMONY)
    assert calls == [] and "not json" in content


def test_a_streamed_call_goes_out_whole():
    _, text = HarmonyReasoning().whole(ANALYSIS + "Think." + CALL)
    stream = ToolCallStream(ToolFormat.HARMONY)
    pieces = [stream.push(text[i:i + 7]) for i in range(0, len(text), 7)] + [stream.finish()]
    assert "".join(p.content for p in pieces) == ""
    assert [c.name for p in pieces for c in p.calls] == ["weather"]


def test_a_forced_call_grammar_writes_the_message_to_the_function():
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    grammar = tool_call_grammar(tools, "weather", False, ToolFormat.HARMONY)
    assert '"<|channel|>commentary to=functions.weather <|constrain|>json<|message|>"' in grammar
    assert "%json" in grammar
