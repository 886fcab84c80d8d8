"""`suffix` on /v1/completions (fill in the middle) on the tiny chat model, its vocabulary given StarCoder's FIM
tokens in place of three unused special tokens: the prompt the engine runs is `PRE prefix SUF suffix MID`
(the same tokens as that prompt sent as ids), the FIM end tokens stop it, and a model without FIM tokens, or
echo with a suffix, is a 400."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from in_process_server import InProcessServer, make_state

from model.tokenizer import Tokenizer

FIM = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
PREFIX, SUFFIX = "def area(radius):\n    return ", " * radius ** 2\n\nprint(area(2))\n"


@pytest.fixture(scope="module")
def fim_dir(tiny_dir, tmp_path_factory):
    """The tiny chat model with ids 3, 4, 5 (<repo_name>, <reponame>, <file_sep>) spelled as FIM tokens."""
    directory = tmp_path_factory.mktemp("fim") / "tiny-fim"
    shutil.copytree(tiny_dir, directory)
    data = json.loads((directory / "tokenizer.json").read_text())
    for token_id, spelling in zip((3, 4, 5), FIM):
        old = next(t for t in data["added_tokens"] if t["id"] == token_id)
        data["model"]["vocab"].pop(old["content"], None)
        data["model"]["vocab"][spelling] = token_id
        old["content"] = spelling
    (directory / "tokenizer.json").write_text(json.dumps(data))
    return directory


@pytest.fixture(scope="module")
def server(fim_dir):
    server = InProcessServer(make_state(fim_dir))
    yield server
    server.stop()


def complete(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60)


def test_the_fim_tokens_are_found_by_their_spelling(fim_dir, tiny_dir):
    tokenizer = Tokenizer.from_hf_dir(fim_dir)
    assert tokenizer.fim_token_ids == (3, 4, 5)
    assert Tokenizer.from_hf_dir(tiny_dir).fim_token_ids is None
    ids = tokenizer.encode_fim(tokenizer.encode("a"), "b")
    assert ids == [3, *tokenizer.encode("a"), 4, *tokenizer.encode("b", add_special_tokens=False), 5]
    # The FIM end tokens a vocabulary has: here <|endoftext|>.
    assert tokenizer.fim_stop_ids == {0}


def test_a_suffix_runs_the_prefix_suffix_middle_prompt(server):
    tokenizer = server.state.engine.info.tokenizer
    ids = [3, *tokenizer.encode(PREFIX), 4, *tokenizer.encode(SUFFIX, add_special_tokens=False), 5]
    common = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    filled = complete(server, {"prompt": PREFIX, "suffix": SUFFIX, **common}).json()
    by_ids = complete(server, {"prompt": ids, **common}).json()
    assert filled["usage"]["prompt_tokens"] == len(ids)
    assert filled["choices"][0]["text"] == by_ids["choices"][0]["text"]
    # Streamed, the same middle.
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": PREFIX, "suffix": SUFFIX, "stream": True, **common}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events) == filled["choices"][0]["text"]


def test_the_fim_end_token_ends_the_middle(server):
    """A logit bias makes <|endoftext|> the model's choice: with ignore_eos it is not EOS here, but as the
    FIM end token it still ends the answer."""
    out = complete(server, {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 8, "temperature": 0,
                            "ignore_eos": True, "logit_bias": {"0": 100}}).json()
    assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 1


def test_bad_uses_of_suffix_are_refused(server, tiny_dir):
    echoed = complete(server, {"prompt": PREFIX, "suffix": SUFFIX, "echo": True})
    assert echoed.status_code == 400 and "echo with a suffix" in echoed.json()["error"]["message"]
    plain = InProcessServer(make_state(tiny_dir))
    try:
        response = complete(plain, {"prompt": PREFIX, "suffix": SUFFIX})
        assert response.status_code == 400 and response.json()["error"]["param"] == "suffix"
        assert "FIM tokens" in response.json()["error"]["message"]
    finally:
        plain.stop()
