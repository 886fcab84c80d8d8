"""POST /v1/responses (server/responses.py) on the tiny chat model through the official openai client: the same
tokens as the chat completion it translates to, streamed or not; function calls out and their outputs back in;
structured text; the typed stream events in order; refused fields named."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from in_process_server import InProcessServer, make_state

KEY = "responses-key"
UNIT = {"type": "function", "name": "set_unit", "description": "Choose the unit.",
        "parameters": {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["unit"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tiny_dir):
    server = InProcessServer(make_state(tiny_dir, api_key=KEY, max_model_len=512))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def test_text_equals_the_chat_completion_it_translates_to(client):
    out = client.responses.create(model="tiny-chat", instructions="Be brief.", input="Name a color.",
                                  max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(model="tiny-chat", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}])
    assert out.object == "response" and out.id.startswith("resp_") and out.model == "tiny-chat"
    assert out.output_text == chat.choices[0].message.content
    assert out.usage.input_tokens == chat.usage.prompt_tokens
    assert out.usage.output_tokens == chat.usage.completion_tokens == 12
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in out.output] == ["message"] and out.output[0].role == "assistant"


def test_the_stream_gives_the_same_text_in_typed_events(server, client):
    body = {"model": "tiny-chat", "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
            "max_output_tokens": 10, "temperature": 0}
    whole = client.responses.create(**body)
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=60,
                      headers={"authorization": f"Bearer {KEY}"}) as response:
        lines = [line for line in response.iter_lines() if line]
    kinds = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    events = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert kinds == [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == whole.output_text == events[-1]["response"]["output"][0]["content"][0]["text"]
    assert events[-1]["response"]["usage"]["output_tokens"] == 10


def test_a_function_call_out_and_its_output_back_in(server, client):
    out = client.responses.create(model="tiny-chat", input="Which unit?", tools=[UNIT], tool_choice="required",
                                  max_output_tokens=60, temperature=0)
    chat = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Which unit?"}],
                                          tools=[{"type": "function", "function": {k: v for k, v in UNIT.items()
                                                                                   if k != "type"}}],
                                          tool_choice="required", max_tokens=60, temperature=0)
    call = out.output[-1]
    assert call.type == "function_call" and call.name == "set_unit" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["unit"] in ("celsius", "fahrenheit")
    assert call.arguments == chat.choices[0].message.tool_calls[0].function.arguments
    # The random model keeps writing the whitespace JSON allows after the call: both end at the length.
    assert (out.status, chat.choices[0].finish_reason) in (("completed", "tool_calls"), ("incomplete", "length"))
    body = {"model": "tiny-chat", "input": "Which unit?", "tools": [UNIT], "tool_choice": "required",
            "max_output_tokens": 60, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60,
                      headers={"authorization": f"Bearer {KEY}"}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0]["arguments"] == call.arguments
    calls = [item for item in events[-1]["response"]["output"] if item["type"] == "function_call"]
    assert [item["name"] for item in calls] == ["set_unit"]
    # The conversation goes back whole: the call, then its output as a tool turn.
    follow = [{"role": "user", "content": "Which unit?"},
              {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": "done"}]
    again = client.responses.create(model="tiny-chat", input=follow, tools=[UNIT], max_output_tokens=4,
                                    temperature=0)
    counted = httpx.post(server.url + "/tokenize", headers={"authorization": f"Bearer {KEY}"}, timeout=60, json={
        "messages": [{"role": "user", "content": "Which unit?"},
                     {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                      "function": {"name": call.name, "arguments": call.arguments}}]},
                     {"role": "tool", "tool_call_id": call.call_id, "content": "done"}],
        "tools": [{"type": "function", "function": {k: v for k, v in UNIT.items() if k != "type"}}]}).json()
    assert again.usage.input_tokens == counted["count"]


def test_structured_text_follows_its_schema(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    out = client.responses.create(model="tiny-chat", input="Yes or no?", max_output_tokens=40, temperature=0,
                                  text={"format": {"type": "json_schema", "name": "verdict", "schema": schema,
                                                   "strict": True}})
    assert out.status == "completed" and json.loads(out.output_text)["answer"] in ("yes", "no")
    assert out.text.format.type == "json_schema"


def test_previous_response_id_continues_a_stored_conversation(server, client):
    """A response is kept unless store is false: the next request naming it continues its conversation (its
    instructions not carried over, as OpenAI's API does), streamed responses too; GET returns it, DELETE
    forgets it."""
    headers = {"authorization": f"Bearer {KEY}"}
    first = client.responses.create(model="tiny-chat", instructions="Be brief.", input="Hi", max_output_tokens=6,
                                    temperature=0)
    assert first.store is True and first.previous_response_id is None
    second = client.responses.create(model="tiny-chat", input="And then?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    assert second.previous_response_id == first.id
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And then?"}]
    counted = httpx.post(server.url + "/tokenize", headers=headers, json={"messages": messages}, timeout=60).json()
    assert second.usage.input_tokens == counted["count"]
    # The same tokens as the whole conversation sent at once.
    whole = client.responses.create(model="tiny-chat", input=messages, max_output_tokens=6, temperature=0,
                                    store=False)
    assert whole.output_text == second.output_text and whole.store is False
    with client.responses.stream(model="tiny-chat", input="More", previous_response_id=second.id,
                                 max_output_tokens=4, temperature=0, extra_body={"ignore_eos": True}) as stream:
        events = list(stream)  # to the end: a stream left early is aborted, and nothing is stored
    streamed_id = next(e for e in events if e.type == "response.created").response.id
    assert client.responses.retrieve(streamed_id).previous_response_id == second.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    for missing in (whole.id, "resp_unknown"):
        response = httpx.get(server.url + f"/v1/responses/{missing}", headers=headers, timeout=60)
        assert response.status_code == 404 and response.json()["error"]["code"] == "response_not_found"
    deleted = httpx.delete(server.url + f"/v1/responses/{first.id}", headers=headers, timeout=60).json()
    assert deleted == {"id": first.id, "object": "response", "deleted": True}
    assert httpx.get(server.url + f"/v1/responses/{first.id}", headers=headers, timeout=60).status_code == 404


def test_the_store_keeps_its_bound():
    from server.response_store import ResponseStore

    store = ResponseStore(max_chars=1000)
    for i in range(20):
        store.put({"id": f"resp_{i}", "output": []}, [{"role": "user", "content": "x" * 100}])
    assert store.num_chars <= 1000 and len(store) < 20 and store.get("resp_19") is not None
    assert store.get("resp_0") is None
    store.put({"id": "big", "output": []}, [{"role": "user", "content": "x" * 2000}])
    assert store.get("big") is None  # larger than the whole bound: not kept


@pytest.mark.parametrize("body,status,fragment", [
    ({"input": "x", "previous_response_id": "resp_1"}, 404, "previous_response_id"),
    ({"input": "x", "conversation": "conv_1"}, 400, "conversation"),
    ({"input": "x", "background": True}, 400, "background"),
    ({"input": "x", "reasoning": {"effort": "low"}}, 400, "reasoning"),
    ({"input": []}, 400, "input"),
    ({"input": ""}, 400, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "takes no images"),
    ({"input": [{"type": "web_search_call"}]}, 400, "web_search_call"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"input": "x", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x", "truncation": "auto"}, 400, "truncation"),
    ({"input": "x", "model": "gpt-9"}, 404, "gpt-9"),
    ({"input": [{"role": "wizard", "content": "x"}]}, 400, "role"),
])
def test_bad_requests_name_what_is_wrong(server, body, status, fragment):
    response = httpx.post(server.url + "/v1/responses", json=body, headers={"authorization": f"Bearer {KEY}"},
                          timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert fragment in error["message"] or fragment == error["param"], error
