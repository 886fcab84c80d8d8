"""`ladder bench` end to end on a tiny model: both sides run the workload and the report says how."""

from __future__ import annotations

import json

from ladder.cli import main
from tiny_models import make_hf_model


def test_bench_runs_both_sides_and_writes_json(tmp_path, capsys):
    model_dir = tmp_path / "model"
    make_hf_model("llama3", model_dir)
    out = tmp_path / "bench.json"
    code = main(["bench", "--model", str(model_dir), "--num-prompts", "3", "--input-len", "8", "--output-len", "4",
                 "--hf-dtype", "bf16", "--out", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["num_prompt_tokens"] == 24 and report["num_output_tokens"] == 12
    ladder, transformers = report["results"]["ladder"], report["results"]["transformers"]
    assert transformers["dtype"] == "bfloat16"
    assert ladder["speedup"] == transformers["seconds"] / ladder["seconds"]
    assert ladder["output_tokens_per_s"] == 12 / ladder["seconds"]
    printed = capsys.readouterr().out
    assert "transformers ran in bfloat16" in printed and f"wrote {out}" in printed


def test_bench_of_one_prompt(tmp_path):
    """One user's figure: the warm-up takes the one prompt there is."""
    model_dir = tmp_path / "model"
    make_hf_model("llama3", model_dir)
    out = tmp_path / "bench.json"
    assert main(["bench", "--model", str(model_dir), "--num-prompts", "1", "--input-len", "8", "--output-len", "4",
                 "--skip-hf", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["num_output_tokens"] == 4
