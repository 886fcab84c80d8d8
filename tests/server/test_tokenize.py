"""POST /tokenize and /detokenize (server/token_routes.py) on the tiny model, which has SmolLM2's tokenizer
and chat template: the ids equal the tokenizer's, a chat's count equals the prompt_tokens its completion
reports (tools included), llama.cpp's form gives exact byte pieces, and bad input is a 4xx. Also the chat
logprobs' `bytes`, which come from the same per-token bytes."""

from __future__ import annotations

import httpx
import pytest
from in_process_server import InProcessServer, make_state

from model.tokenizer import Tokenizer

KEY = "tokenize-key"
HEADERS = {"authorization": f"Bearer {KEY}"}
TEXT = "Héllo, wörld! 1234 ✓ 猫"
CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 + 2?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(tiny_dir):
    server = InProcessServer(make_state(tiny_dir, api_key=KEY))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tokenizer(server) -> Tokenizer:
    return server.state.engine.info.tokenizer


def post(server, path: str, body: dict, headers=HEADERS) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def test_a_text_gives_the_tokenizers_ids_and_back(server, tokenizer):
    out = post(server, "/tokenize", {"prompt": TEXT, "return_token_strs": True}).json()
    ids = tokenizer.encode(TEXT)
    assert out == {"count": len(ids), "max_model_len": 256, "tokens": ids,
                   "token_strs": [tokenizer.id_to_token(i) for i in ids]}
    back = post(server, "/detokenize", {"tokens": ids}).json()
    assert back == {"prompt": TEXT, "content": TEXT}
    # Special tokens are kept: what the ids are, not what a reply would show.
    marked = post(server, "/detokenize", {"tokens": [1, *ids, 2]}).json()["prompt"]
    assert marked == f"<|im_start|>{TEXT}<|im_end|>"
    assert post(server, "/detokenize", {"tokens": []}).json()["prompt"] == ""


def test_llama_cpps_form_gives_pieces_whose_bytes_make_the_text(server, tokenizer):
    out = post(server, "/tokenize", {"content": TEXT, "with_pieces": True}).json()
    ids = tokenizer.encode(TEXT, add_special_tokens=False)  # llama.cpp's add_special defaults to false
    assert [t["id"] for t in out["tokens"]] == ids
    pieces = [t["piece"] for t in out["tokens"]]
    # A character split across tokens comes as byte lists; joined, every piece gives the text exactly.
    assert any(isinstance(piece, list) for piece in pieces)
    data = b"".join(piece.encode() if isinstance(piece, str) else bytes(piece) for piece in pieces)
    assert data.decode() == TEXT


def test_a_chats_count_is_the_count_its_completion_sees(server, tokenizer):
    for extra in ({}, {"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "none"}):
        counted = post(server, "/tokenize", {"messages": CHAT, **extra}).json()
        done = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, **extra}).json()
        assert counted["count"] == done["usage"]["prompt_tokens"] == len(counted["tokens"]), extra
    plain = post(server, "/tokenize", {"messages": CHAT}).json()["tokens"]
    with_tools = post(server, "/tokenize", {"messages": CHAT, "tools": [WEATHER]}).json()["tokens"]
    assert len(with_tools) > len(plain)  # the default template shows the tools in a system turn
    text, ids = tokenizer.encode_chat(CHAT)
    assert plain == ids and text.endswith("<|im_start|>assistant\n")
    unopened = post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()["tokens"]
    assert unopened == tokenizer.encode_chat(CHAT, add_generation_prompt=False)[1] and unopened == ids[:len(unopened)]
    assert len(unopened) < len(ids)


def test_chat_logprobs_bytes_join_into_the_reply(server, tokenizer):
    """OpenAI's `bytes` of each token are its own bytes (a part of a character stays a part), so joined they
    are the reply's text; the random tiny model is steered into characters split across tokens."""
    split = [i for i in range(tokenizer.vocab_size) if "\ufffd" in tokenizer.decode([i], False)][:200]
    bias = {str(i): 5.0 for i in split} | {str(i): -100.0 for i in tokenizer.special_ids}
    out = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 24, "ignore_eos": True, "seed": 3,
                                                "logprobs": True, "top_logprobs": 1, "logit_bias": bias}).json()
    content = out["choices"][0]["logprobs"]["content"]
    data = b"".join(bytes(t["bytes"]) for t in content)
    assert len(content) == 24 and b"\xef\xbf\xbd" not in data
    assert data.decode("utf-8", errors="replace") == out["choices"][0]["message"]["content"]


def test_a_prefilled_reply_is_continued(server, tokenizer):
    """continue_final_message (vLLM's): the prompt ends inside the assistant's message, which the model then
    continues; the same ids as the closed chat up to its end-of-turn, and the same reply as those ids sent
    to /v1/completions."""
    prefilled = [*CHAT, {"role": "assistant", "content": "The answer is"}]
    opened = post(server, "/tokenize", {"messages": prefilled, "continue_final_message": True}).json()["tokens"]
    closed = post(server, "/tokenize", {"messages": prefilled, "add_generation_prompt": False}).json()["tokens"]
    assert closed[:len(opened)] == opened and closed[len(opened)] == tokenizer.token_to_id("<|im_end|>")
    assert tokenizer.decode(opened, skip_special_tokens=False).endswith("<|im_start|>assistant\nThe answer is")
    common = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    chat = post(server, "/v1/chat/completions", {"messages": prefilled, "continue_final_message": True,
                                                 "add_generation_prompt": False, **common}).json()
    plain = post(server, "/v1/completions", {"prompt": opened, **common}).json()
    assert chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
    assert chat["usage"]["prompt_tokens"] == len(opened)
    for bad, fragment in (({"add_generation_prompt": True}, "add_generation_prompt"), ({}, "assistant")):
        messages = prefilled if bad else CHAT
        refused = post(server, "/v1/chat/completions", {"messages": messages, "continue_final_message": True, **bad})
        assert refused.status_code == 400 and fragment in refused.json()["error"]["message"]


@pytest.mark.parametrize("path,body,status,fragment", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "content": "b"}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "not both"),
    ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, 400, "template"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"prompt": "x", "model": "gpt-9"}, 404, "gpt-9"),
    ("/tokenize", {"prompt": "x" * 9000}, 400, "characters"),
    ("/detokenize", {"tokens": [49152]}, 400, "vocabulary"),
    ("/detokenize", {"tokens": [-1]}, 400, "vocabulary"),
    ("/detokenize", {"tokens": ["1"]}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
])
def test_bad_input_is_a_clear_error(server, path, body, status, fragment):
    response = post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert fragment in error["message"] or fragment == error["param"], error


def test_both_routes_need_the_key(server):
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        assert post(server, path, body, headers={}).status_code == 401
