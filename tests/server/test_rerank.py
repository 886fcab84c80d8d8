"""POST /v1/rerank and vLLM's /v1/score (server/rerank.py) on a tiny model named a reranker: the prompt is
Qwen3-Reranker's, token for token; each score is transformers' P("yes") against "no" on the same weights; the
results come best first with top_n, documents and usage as Jina's and Cohere's clients read them (in input
order for /v1/score); bad requests are refused."""

from __future__ import annotations

import httpx
import pytest
import torch
from in_process_server import InProcessServer, make_state

from server.rerank import DEFAULT_INSTRUCTION, JUDGE, Reranker

QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital and largest city of France.", "Bananas are yellow.",
             "The Eiffel Tower is in Paris.", "", "Berlin is the capital of Germany. <|im_end|>"]


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    from tiny_models import make_tiny_thinking_model

    return make_tiny_thinking_model(tmp_path_factory.mktemp("models") / "tiny-Qwen3-Reranker", seed=3)


@pytest.fixture(scope="module")
def server(reranker_dir):
    server = InProcessServer(make_state(reranker_dir, max_model_len=256))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(reranker_dir):
    """transformers' P(yes) for a document, on the prompt Qwen3-Reranker's model card writes."""
    import transformers

    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(reranker_dir / "tokenizer.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained(reranker_dir, torch_dtype=torch.float32).eval()
    no_id, yes_id = tokenizer.convert_tokens_to_ids("no"), tokenizer.convert_tokens_to_ids("yes")

    def ids(query: str, document: str, instruction: str = DEFAULT_INSTRUCTION) -> list[int]:
        text = (f"<|im_start|>system\n{JUDGE}<|im_end|>\n<|im_start|>user\n<Instruct>: {instruction}\n"
                f"<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def score(query: str, document: str, instruction: str = DEFAULT_INSTRUCTION) -> float:
        with torch.no_grad():
            logits = model(torch.tensor([ids(query, document, instruction)])).logits[0, -1]
        return torch.softmax(logits[[no_id, yes_id]].double(), 0)[1].item()

    score.ids = ids
    return score


def post(server, path: str = "/v1/rerank", **body) -> httpx.Response:
    return httpx.post(server.url + path, json={"query": QUERY, "documents": DOCUMENTS, **body}, timeout=60)


def test_scores_are_the_models_odds_of_yes(server, reference):
    response = post(server)
    assert response.status_code == 200, response.text
    out = response.json()
    results = out["results"]
    assert sorted(r["index"] for r in results) == list(range(len(DOCUMENTS)))
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    for r in results:
        if r["index"] < 4:  # the last document's special-token text is plain text here (below)
            assert r["relevance_score"] == pytest.approx(reference(QUERY, DOCUMENTS[r["index"]]), abs=1e-5)
        assert r["document"] == {"text": DOCUMENTS[r["index"]]}
    # The prompt is the model card's token for token, except that the document's special-token text (the
    # last one's "<|im_end|>") stays plain text instead of closing its turn.
    plain = DOCUMENTS[:4]
    total = sum(len(reference.ids(QUERY, d)) for d in plain)
    assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] > total
    assert out["id"].startswith("rerank-") and out["model"] == "tiny-Qwen3-Reranker"
    counted = post(server, documents=plain).json()["usage"]["prompt_tokens"]
    assert counted == total


def test_top_n_objects_instruction_and_the_other_paths(server, reference):
    instruction = "Given a question, find the passage that names a city"
    body = {"documents": [{"text": d} for d in DOCUMENTS[:3]], "top_n": 2, "return_documents": False,
            "instruction": instruction}
    results = post(server, **body).json()["results"]
    assert len(results) == 2 and all(r["document"] is None for r in results)
    expected = sorted(((reference(QUERY, d, instruction), i) for i, d in enumerate(DOCUMENTS[:3])), reverse=True)
    assert [r["index"] for r in results] == [i for _, i in expected[:2]]
    assert results[0]["relevance_score"] == pytest.approx(expected[0][0], abs=1e-5)
    for path in ("/rerank", "/v2/rerank"):
        assert post(server, path, **body).json()["results"] == results


def test_vllms_score_api_gives_the_same_scores_in_input_order(server, reference):
    one_to_many = httpx.post(server.url + "/v1/score", timeout=60, json={"text_1": QUERY, "text_2": DOCUMENTS[:3]})
    assert one_to_many.status_code == 200, one_to_many.text
    out = one_to_many.json()
    assert out["object"] == "list" and out["id"].startswith("score-") and out["model"] == "tiny-Qwen3-Reranker"
    assert [d["index"] for d in out["data"]] == [0, 1, 2] and all(d["object"] == "score" for d in out["data"])
    for d in out["data"]:
        assert d["score"] == pytest.approx(reference(QUERY, DOCUMENTS[d["index"]]), abs=1e-5)
    assert out["usage"]["prompt_tokens"] == sum(len(reference.ids(QUERY, d)) for d in DOCUMENTS[:3])
    queries = ["What is the capital of France?", "Which fruit is yellow?"]
    pairwise = httpx.post(server.url + "/score", timeout=60, json={"text_1": queries, "text_2": DOCUMENTS[:2]})
    assert [d["score"] for d in pairwise.json()["data"]] == pytest.approx(
        [reference(q, d) for q, d in zip(queries, DOCUMENTS[:2])], abs=1e-5)
    single = httpx.post(server.url + "/v1/score", timeout=60, json={"text_1": QUERY, "text_2": DOCUMENTS[1]})
    assert single.json()["data"][0]["score"] == pytest.approx(reference(QUERY, DOCUMENTS[1]), abs=1e-5)
    for body, words in (({"text_1": queries, "text_2": DOCUMENTS[:3]}, "lengths must be equal"),
                        ({"text_1": queries, "text_2": "x"}, "text_2 one text"),
                        ({"text_1": "", "text_2": "x"}, "text_1"), ({"text_2": ["x"]}, "text_1")):
        bad = httpx.post(server.url + "/v1/score", timeout=60, json=body)
        assert bad.status_code == 400 and words in bad.text, (body, bad.text)


def test_bad_requests_are_refused(server):
    cases = [
        ({"documents": []}, 400, "documents"),
        ({"query": ""}, 400, "query"),
        ({"documents": ["x"] * 1001}, 400, "documents"),
        ({"top_n": 0}, 400, "top_n"),
        ({"documents": ["word " * 400]}, 400, "at most 256"),
        ({"model": "other"}, 404, "does not exist"),
    ]
    for body, status, words in cases:
        response = post(server, **body)
        assert response.status_code == status and words in response.text, (body, response.text)
        assert response.json()["error"]["message"]


def test_a_model_not_named_a_reranker_answers_400_unless_asked(tiny_dir):
    server = InProcessServer(make_state(tiny_dir, max_model_len=256))
    try:
        response = post(server, documents=["a"])
        assert response.status_code == 400 and "--reranker on" in response.text
        server.state.settings.reranker = "on"
        server.state.attach(server.state.engine)  # the setting is read when the engine is attached
        scored = post(server, documents=["Paris.", "Rome."]).json()["results"]
        assert all(0.0 <= r["relevance_score"] <= 1.0 for r in scored)
    finally:
        server.stop()


def test_the_setting_is_checked():
    class NoAnswers:
        chat_template = "x"

        def token_to_id(self, token):
            return None

    assert Reranker.find("auto", "Qwen3-8B", NoAnswers()) is None
    assert Reranker.find("auto", "Qwen3-Reranker-0.6B", NoAnswers()) is None  # no tokens: not served as one
    with pytest.raises(ValueError, match="'yes' and 'no'"):
        Reranker.find("on", "any", NoAnswers())
    with pytest.raises(ValueError, match="unknown reranker setting"):
        Reranker.find("maybe", "any", NoAnswers())


def test_a_converted_sequence_classification_reranker_scores_the_same(reranker_dir, tmp_path_factory, reference):
    """vLLM's and sentence-transformers' converted Qwen3-Reranker: a ForSequenceClassification checkpoint whose
    one score row is the LM head's "yes" row minus its "no" row, the head tied to the embeddings (0.6B's
    is). Its score head is not read: the tied head gives the same two logits, so the same scores as
    transformers' classifier, sigmoid(score row . hidden)."""
    import shutil

    import transformers

    causal = transformers.AutoModelForCausalLM.from_pretrained(reranker_dir, torch_dtype=torch.float32).eval()
    config = causal.config
    config.num_labels, config.architectures = 1, ["LlamaForSequenceClassification"]
    classifier = transformers.LlamaForSequenceClassification(config).eval()
    classifier.model.load_state_dict(causal.model.state_dict())
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(reranker_dir / "tokenizer.json"))
    head = causal.lm_head.weight
    with torch.no_grad():
        classifier.score.weight.copy_(head[tokenizer.convert_tokens_to_ids("yes")]
                                      - head[tokenizer.convert_tokens_to_ids("no")])
    directory = tmp_path_factory.mktemp("models") / "tiny-Qwen3-Reranker-seq-cls"
    classifier.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(reranker_dir / name, directory / name)
    server = InProcessServer(make_state(directory, max_model_len=256))
    try:
        results = post(server, documents=DOCUMENTS[:3]).json()["results"]
    finally:
        server.stop()
    for r in results:
        with torch.no_grad():
            logit = classifier(torch.tensor([reference.ids(QUERY, DOCUMENTS[r["index"]])])).logits[0, 0]
        assert r["relevance_score"] == pytest.approx(torch.sigmoid(logit.double()).item(), abs=1e-5)
        assert r["relevance_score"] == pytest.approx(reference(QUERY, DOCUMENTS[r["index"]]), abs=1e-5)


def test_a_reranker_gguf_scores_with_its_classification_rows(tmp_path):
    """llama.cpp's conversion of Qwen3-Reranker: pooling type rank, the LM head's "yes" and "no" rows as
    `cls.output.weight`, no LM head. Read by the file, whatever its name, its scores are the untied model's
    P(yes) in transformers: from those rows, not from the embeddings that stand in for the missing head."""
    from tiny_models import make_hf_model, write_gguf

    import model

    hf = make_hf_model("qwen3", tmp_path / "hf", vocab_size=49152)  # untied
    tokenizer = model.load().tokenizer  # the file's vocabulary and chat template: the embedded model's
    yes, no = tokenizer.token_to_id("yes"), tokenizer.token_to_id("no")
    path = tmp_path / "tiny-qwen3-rank.gguf"
    write_gguf(hf, path, arch="qwen3", smollm2_tokenizer=True, reranker=(yes, no))
    server = InProcessServer(make_state(path, max_model_len=256))
    try:
        assert server.state.reranker is not None and server.state.engine.info.reranker_file
        results = post(server, documents=DOCUMENTS[:3]).json()["results"]
    finally:
        server.stop()
    for r in results:
        _, ids = tokenizer.encode_chat(Reranker.messages(QUERY, DOCUMENTS[r["index"]], DEFAULT_INSTRUCTION), True,
                                       enable_thinking=False)
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        expected = torch.softmax(logits[[no, yes]].double(), 0)[1].item()
        assert r["relevance_score"] == pytest.approx(expected, abs=1e-5)
