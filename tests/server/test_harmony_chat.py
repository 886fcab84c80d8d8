"""GPT-OSS's harmony chat through the server, on a tiny random GPT-OSS whose tokenizer holds harmony's tokens as
special tokens (as its Hugging Face tokenizer does): the analysis channel read as `reasoning_content`, the final
channel as content without its header, a message to a function read as an OpenAI tool call (whole and streamed),
forced calls written as such messages, `reasoning_effort` given to the template, and past analysis given back.
Replies are forced by grammars naming the markers as their single tokens (`<[id]>`), as the model writes them."""

from __future__ import annotations

import asyncio
import functools
import json

import httpx
import pytest
from in_process_server import InProcessServer, chat_completion, chat_events, make_state

from model.tokenizer import Tokenizer
from server import protocol as p
from server.errors import APIError
from server.harmony import HarmonyFormat
from server.prompts import chat_prompt_ids
from server.tool_calls import ToolFormat

NAME = "gpt-oss-chat"
# Token ids of the tiny model's added tokens (tests/support/tiny_models.py HARMONY_TOKENS, from 49,152).
START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = range(49152, 49159)
THINK_THEN_ANSWER = (f'start: <[{CHANNEL}]> "analysis" <[{MESSAGE}]> /[a-z]{{2,6}}( [a-z]{{2,6}}){{1,3}}/ <[{END}]> '
                     f'<[{START}]> "assistant" <[{CHANNEL}]> "final" <[{MESSAGE}]> /[A-Z][a-z]{{1,8}}/')
THINK_THEN_CALL = (f'start: <[{CHANNEL}]> "analysis" <[{MESSAGE}]> /[a-z]{{2,6}}/ <[{END}]> <[{START}]> "assistant" '
                   f'<[{CHANNEL}]> "commentary to=functions.get_weather " <[{CONSTRAIN}]> "json" <[{MESSAGE}]> '
                   '"{\\"city\\": \\"Paris\\"}"')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_models import make_tiny_harmony_chat_model

    return make_tiny_harmony_chat_model(tmp_path_factory.mktemp("models") / "tiny-gpt-oss")


@pytest.fixture(scope="module")
def server(model_dir):
    server = InProcessServer(make_state(model_dir, served_model_name=NAME, max_model_len=512))
    yield server
    server.stop()


chat = functools.partial(chat_completion, model=NAME)
stream = functools.partial(chat_events, model=NAME)


def test_the_headers_stay_in_the_text_and_the_reply_ends_at_return_or_call(model_dir):
    tokenizer = Tokenizer.from_hf_dir(model_dir)
    assert tokenizer.decode([START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN]) == \
        "<|start|><|channel|><|message|><|constrain|>"
    assert tokenizer.stop_token_ids == {RETURN, CALL}  # <|end|> closes the analysis, not the reply
    assert HarmonyFormat.find(tokenizer) == HarmonyFormat(START, END)


def test_the_analysis_is_reasoning_and_the_final_message_content(server):
    reply = chat(server, guided_grammar=THINK_THEN_ANSWER, logprobs=True).json()
    message = reply["choices"][0]["message"]
    tokens = [entry["token"] for entry in reply["choices"][0]["logprobs"]["content"]]
    assert tokens[:3] == ["<|channel|>", "analysis", "<|message|>"]
    assert message["reasoning_content"] and message["reasoning_content"].islower()
    assert message["content"][0].isupper() and "<|" not in message["content"]
    assert reply["choices"][0]["finish_reason"] == "stop"
    events = stream(server, guided_grammar=THINK_THEN_ANSWER)
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    hidden = chat(server, guided_grammar=THINK_THEN_ANSWER, include_reasoning=False).json()["choices"][0]["message"]
    assert hidden.get("reasoning_content") is None and hidden["content"] == message["content"]


def test_a_message_to_a_function_is_a_tool_call(server):
    reply = chat(server, guided_grammar=THINK_THEN_CALL, tools=TOOLS).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"})]
    assert choice["message"]["reasoning_content"]
    events = stream(server, guided_grammar=THINK_THEN_CALL, tools=TOOLS)
    deltas = [c["delta"] for e in events for c in e["choices"]]
    streamed = [call for d in deltas for call in d.get("tool_calls") or ()]
    assert [c["function"]["name"] for c in streamed] == ["get_weather"]
    assert not "".join(d.get("content") or "" for d in deltas)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_forced_call_is_written_as_a_message_to_the_function(server):
    """The grammar spells the header as text (the random model may pick the markers' characters; a trained one
    takes their tokens) and the arguments by the schema (a closed one here, so the random model finishes)."""
    closed = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}}}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        reply = chat(server, tools=closed, tool_choice=choice, parallel_tool_calls=False,
                     logit_bias={str(END): 100}).json()  # an analysis (allowed first) ends at once
        calls = reply["choices"][0]["message"]["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["get_weather"]
        assert json.loads(calls[0]["function"]["arguments"])["city"] in ("Paris", "Oslo")
        assert reply["choices"][0]["finish_reason"] == "tool_calls"


def prompt_text(tokenizer: Tokenizer, **fields) -> str:
    body = p.ChatCompletionRequest(model=NAME, messages=[{"role": "user", "content": "Hi"}], **fields)
    ids, _ = asyncio.run(chat_prompt_ids(tokenizer, body, ToolFormat.HARMONY, None, False))
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_reasoning_effort_reaches_a_template_that_reads_it_and_is_refused_elsewhere(model_dir, tmp_path):
    tokenizer = Tokenizer.from_hf_dir(model_dir)
    assert "Reasoning: high" in prompt_text(tokenizer, reasoning_effort="high")
    assert "Reasoning: medium" in prompt_text(tokenizer)
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(APIError, match="reasoning_effort"):
        prompt_text(tokenizer, reasoning_effort="low")


def test_a_past_calls_analysis_goes_back_as_thinking(server):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "reasoning_content": "need the tool",
                 "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out = httpx.post(server.url + "/tokenize", json={"model": NAME, "messages": messages, "tools": TOOLS},
                     timeout=60).json()
    text = server.state.engine.info.tokenizer.decode(out["tokens"], skip_special_tokens=False)
    assert "<|channel|>analysis<|message|>need the tool<|end|>" in text
    assert '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}' in text


def test_a_guide_holds_for_the_answer_after_a_free_analysis(model_dir):
    """`response_format` under harmony: an analysis message may come first (any text up to <|end|>), then the
    final channel's header, then the guided answer; without the header the answer is refused."""
    import llguidance

    from engine.guide import Guide, GuideCompiler

    tokenizer = Tokenizer.from_hf_dir(model_dir)
    harmony = HarmonyFormat.find(tokenizer)
    schema = Guide.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    guide = harmony.guide_answer(schema, forced_call=False)
    compiler = GuideCompiler(tokenizer, tokenizer.vocab_size)
    compiler.compile(guide)  # compiles for the vocabulary

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(compiler._llg_tokenizer_locked(), guide.grammar_text())
        ids = [i for piece in text.split("<|end|>") for i in (*tokenizer.encode(piece, add_special_tokens=False),
                                                                 END)][:-1]
        return matcher.consume_tokens(ids) and matcher.is_accepting()

    assert accepts('<|channel|>analysis<|message|>Some thinking, any text.<|end|><|start|>assistant'
                   '<|channel|>final<|message|>{"n":3}')
    assert accepts('<|channel|>final<|message|>{"n":3}')
    assert not accepts('{"n":3}')
    assert harmony.guide_answer(Guide.grammar('start: "x"'), forced_call=False).kind == "lark"  # the user's own


def test_response_format_answers_after_the_analysis(server):
    """The random model is pushed to end its analysis at once (a logit bias on <|end|>): the reply's content is
    the JSON the schema asks for, its headers gone."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}}, "required": ["n"],
              "additionalProperties": False}
    reply = chat(server, max_tokens=80, logit_bias={str(END): 100},
                 response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema,
                                                                         "strict": True}}).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert set(json.loads(choice["message"]["content"])) == {"n"}


def test_the_responses_api_returns_the_analysis_as_a_reasoning_item(server):
    body = {"model": NAME, "input": "Weather in Paris?", "max_output_tokens": 60, "temperature": 0,
            "guided_grammar": THINK_THEN_ANSWER}
    chat_reply = chat(server, guided_grammar=THINK_THEN_ANSWER).json()["choices"][0]["message"]
    whole = httpx.post(server.url + "/v1/responses", json=body, timeout=60).json()
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message"]
    assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": chat_reply["reasoning_content"]}]
    assert whole["output"][1]["content"][0]["text"] == chat_reply["content"]


def test_a_gguf_vocabulary_reads_harmony_as_the_directory_does(tmp_path):
    """llama.cpp's converter writes harmony's tokens as control tokens: the header markers still stay in decoded
    text, and the reply stops at <|return|> and <|call|> but not at <|end|> (which llama.cpp's own end-of-turn
    list holds)."""
    import gguf
    from tiny_models import HARMONY_CHAT_TEMPLATE, HARMONY_TOKENS, copy_smollm2_tokenizer, write_and_close

    from model.gguf_file import GGUFFile

    writer = gguf.GGUFWriter(str(tmp_path / "vocab.gguf"), "gpt-oss")
    copy_smollm2_tokenizer(writer, HARMONY_TOKENS, "<|return|>", HARMONY_CHAT_TEMPLATE)
    write_and_close(writer)
    tokenizer = Tokenizer.from_gguf_metadata(GGUFFile(tmp_path / "vocab.gguf").metadata, "vocab.gguf")
    assert tokenizer.decode([START, CHANNEL, MESSAGE, CONSTRAIN, END]) == "<|start|><|channel|><|message|><|constrain|>"
    assert {RETURN, CALL} <= tokenizer.stop_token_ids and END not in tokenizer.stop_token_ids
    assert HarmonyFormat.find(tokenizer) == HarmonyFormat(START, END)


def test_a_reasoning_parser_for_other_markers_is_refused_at_start(model_dir):
    """vLLM's openai_gptoss names harmony's analysis (taken); think names <think> blocks, which this model has
    not: the server refuses to start with it, in one line."""
    make_state(model_dir, served_model_name=NAME, reasoning_parser="openai_gptoss")
    with pytest.raises(ValueError, match="writes harmony's channels") as error:
        make_state(model_dir, served_model_name=NAME, reasoning_parser="think")
    assert "\n" not in str(error.value)
