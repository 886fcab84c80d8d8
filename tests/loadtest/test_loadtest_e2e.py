"""`ladder loadtest`, run as a user runs it, against a real `ladder serve` of the default model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from server_process import API_KEY

pytestmark = pytest.mark.slow


def test_loadtest_against_ladder_serve(ladder_server, tmp_path):
    before = ladder_server.metrics()
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "ladder.cli", "loadtest", "--base-url", ladder_server.url, "--api-key", API_KEY,
           "--num-requests", "8", "--max-concurrency", "4", "--input-len", "32", "--output-len", "12",
           "--warmup", "0", "--quiet", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "TTFT" in done.stdout and "server (ladder /metrics" in done.stdout
    after = ladder_server.metrics()
    results = json.loads((out / "results.json").read_text())
    point = results["points"][0]
    summary = point["summary"]
    assert summary["num_requests"] == 8 and summary["num_ok"] == 8
    # The client's view agrees with the server's own counters.
    def delta(name):
        return after[name] - before[name]

    assert delta('ladder_requests_finished_total{reason="length"}') == 8
    assert delta("ladder_generation_tokens_total") == summary["output_tokens"] == 8 * 12
    assert delta("ladder_prompt_tokens_total") <= summary["input_tokens"]
    assert point["server_metrics"] is not None
    assert sorted(p.name for p in out.glob("*.png"))
