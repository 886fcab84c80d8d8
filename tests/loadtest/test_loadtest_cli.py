"""`ladder loadtest` end to end through its command line: results.json, plots, the server section,
request bodies, token-count fallbacks and one-line errors."""

import json
import socket

import pytest
from fake_openai_server import FakeServerProcess

from loadtest.__main__ import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server():
    process = FakeServerProcess()
    yield process
    process.close()


def loadtest(server, capsys, *flags):
    code = main(["--base-url", server.url, "--quiet", *flags])
    out, err = capsys.readouterr()
    return code, out, err


def test_out_dir_has_results_and_plots(server, capsys, tmp_path):
    server.configure(ttft=0.02, itl=0.005, ladder_metrics=True)
    code, out, err = loadtest(server, capsys, "--endpoint", "chat", "--max-concurrency", "2", "--num-requests",
                              "10", "--output-len", "6", "--input-len", "12", "--warmup", "2",
                              "--slo", "ttft:500,tpot:100", "--api-key", "sk-secret", "--out", str(tmp_path))
    assert code == 0, err
    assert server.stats()["last_authorization"] == "Bearer sk-secret"
    assert "sk-secret" not in (tmp_path / "results.json").read_text()
    assert "TTFT" in out and "goodput" in out and "100.0% of requests meet" in out
    assert "server (ladder /metrics" in out and "engine steps" in out
    assert server.stats()["num_requests"] == 12  # warmup included on the server, not in the figures
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) == {"config", "model", "environment", "points"}
    assert results["model"] == "fake-model" and results["config"]["endpoint"] == "chat"
    assert results["environment"]["python"]
    [point] = results["points"]
    assert point["summary"]["num_ok"] == 10 and point["summary"]["goodput"] > 0
    requests = point["requests"]
    assert [r["index"] for r in requests] == list(range(2, 12))
    for r in requests:
        assert r["ok"] and len(r["chunk_times"]) == 6 and r["chunk_times"][0] == pytest.approx(r["ttft"], abs=1e-6)
        assert r["output_tokens"] == 6 and r["output_tokens_source"] == "usage"
    server_metrics = point["server_metrics"]
    assert server_metrics["phases"]["prefill"]["count"] == 10
    assert server_metrics["phases"]["prefill"]["mean_ms"] == pytest.approx(19.0)
    assert server_metrics["phases"]["decode"]["mean_ms"] == pytest.approx(25.0)
    assert server_metrics["generation_tokens"] == 60 and server_metrics["finished"] == {"length": 10}
    assert (tmp_path / "latency.png").read_bytes().startswith(PNG_MAGIC)


def test_sweep_writes_a_curve(server, capsys, tmp_path):
    server.configure(ttft=0.005, itl=0.002)
    code, out, err = loadtest(server, capsys, "--sweep", "concurrency=1,3", "--num-requests", "6",
                              "--output-len", "4", "--input-len", "8", "--out", str(tmp_path))
    assert code == 0, err
    assert "sweep over concurrency" in out and "server metrics: not a ladder server" in out
    results = json.loads((tmp_path / "results.json").read_text())
    assert [p["label"] for p in results["points"]] == ["concurrency=1", "concurrency=3"]
    assert [p["summary"]["max_in_flight"] for p in results["points"]] == [1, 3]
    assert results["points"][0]["server_metrics"] is None
    assert results["points"][0]["server_metrics_note"] == "not a ladder server"
    for name in ("sweep.png", "latency_concurrency-1.png", "latency_concurrency-3.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG_MAGIC)


def test_request_body(server, capsys):
    server.configure(ttft=0.001, itl=0.001)
    code, _, err = loadtest(server, capsys, "--num-requests", "1", "--output-len", "3", "--temperature", "0.5",
                            "--extra-body", '{"top_p": 0.9}')
    assert code == 0, err
    body = server.stats()["last_body"]
    assert body["model"] == "fake-model" and body["stream"] is True and body["max_tokens"] == 3
    assert body["ignore_eos"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.5 and body["top_p"] == 0.9 and isinstance(body["prompt"], str)
    code, _, err = loadtest(server, capsys, "--num-requests", "1", "--no-ignore-eos", "--model", "other")
    assert code == 0, err
    body = server.stats()["last_body"]
    assert "ignore_eos" not in body and body["model"] == "other"


def test_token_counts_fall_back_when_there_is_no_usage(server, capsys, tmp_path):
    server.configure(ttft=0.001, itl=0.001, usage=False)
    code, out, err = loadtest(server, capsys, "--num-requests", "2", "--output-len", "5", "--input-len", "7",
                              "--out", str(tmp_path))
    assert code == 0, err
    assert "(estimate)" in out and "(chunks)" in out and "note: output tokens" in out
    requests = json.loads((tmp_path / "results.json").read_text())["points"][0]["requests"]
    assert [(r["output_tokens"], r["output_tokens_source"]) for r in requests] == [(5, "chunks")] * 2
    assert [(r["prompt_tokens"], r["prompt_tokens_source"]) for r in requests] == [(7, "estimate")] * 2

    # A word-level tokenizer: one token per word, so the fake server's " tok0 tok1 ..." is 5 tokens.
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, **{f"tok{i}": i + 1 for i in range(8)}}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    code, out, err = loadtest(server, capsys, "--num-requests", "2", "--output-len", "5", "--input-len", "7",
                              "--tokenizer", str(tmp_path))
    assert code == 0, err
    assert "input 14 (tokenizer) | output 10 of 10 requested (tokenizer)" in out


def test_sharegpt_file_over_chat(server, capsys, tmp_path):
    server.configure(ttft=0.001, itl=0.001)
    data = tmp_path / "sharegpt.jsonl"
    conversation = {"conversations": [{"from": "human", "value": "tell me a story"},
                                      {"from": "gpt", "value": "y" * 24}]}
    data.write_text(json.dumps(conversation) + "\n")
    code, out, err = loadtest(server, capsys, "--dataset", "file", "--dataset-path", str(data), "--endpoint",
                              "chat", "--num-requests", "2")
    assert code == 0, err
    body = server.stats()["last_body"]
    assert body["messages"] == [{"role": "user", "content": "tell me a story"}]
    assert body["max_tokens"] == 6  # the reply's 24 characters at 4 per token
    assert "output 12 of 12 requested" in out


def test_all_requests_failing_exits_non_zero(server, capsys):
    server.configure(faults=["500"])
    code, out, err = loadtest(server, capsys, "--num-requests", "3")
    assert code == 1
    assert "3 failed (http_500 3)" in out
    expected = "ladder loadtest: error: no request of concurrency=1 succeeded; the first: http_500: HTTP 500: injected 500"
    assert err.strip().splitlines() == [expected]


def test_failing_warmup_is_one_line(server, capsys):
    server.configure(faults=["429"])
    code, out, err = loadtest(server, capsys, "--num-requests", "3", "--warmup", "2")
    assert code == 1 and out == ""
    assert len(err.strip().splitlines()) == 1 and "warmup requests failed" in err


def test_unreachable_server_is_one_line(capsys):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again before the run: nothing listens there
    code = main(["--base-url", f"http://127.0.0.1:{port}", "--quiet"])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("ladder loadtest: error: cannot reach the server")


@pytest.mark.parametrize("flags, message", [
    (["--range-ratio", "2"], "--range-ratio"),
    (["--sweep", "speed=1"], "--sweep"),
    (["--slo", "ttft"], "--slo"),
    (["--num-requests", "5", "--duration", "3"], "not both"),
    (["--extra-body", "[1]"], "--extra-body"),
    (["--base-url", "localhost:8000"], "--base-url"),
])
def test_bad_flags_are_one_line(capsys, flags, message):
    code = main(["--quiet", *flags])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err
