"""`ladder doctor` examines what `ladder serve` runs: `--quantization` with serve's choices and default reaches
the engine, the report names it, and the next step fits it; and one batch-1 decode step taken apart op by op,
its rows adding up to the step, every linear kind with its bytes."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from tiny_models import make_hf_model, write_gguf

from doctor.breakdown import LINEAR_KINDS
from doctor.config import DoctorConfig
from doctor.verdict import Evidence, classify
from ladder.cli import build_parser, main

UNDER_MEMORY = dict(queue_share=0.05, overhead_share=0.1, roof_fraction=0.6, roof="memory", weight_bytes=9.6e7)


def quantization_option(command: str):
    sub = next(a for a in build_parser()._actions if hasattr(a, "choices") and a.choices and command in a.choices)
    return next(a for a in sub.choices[command]._actions if "--quantization" in a.option_strings)


def test_doctor_takes_serves_quantization_option():
    serve, doctor = quantization_option("serve"), quantization_option("doctor")
    assert (doctor.choices, doctor.default) == (serve.choices, serve.default) and doctor.default == "auto"
    with pytest.raises(ValueError, match="unknown quantization"):
        DoctorConfig(quantization="q3")
    with pytest.raises(ValueError, match="applies to a model loaded here"):
        DoctorConfig(artifact="a", quantization="w8a8")


@pytest.mark.parametrize("precision", ["w4a8", "w8a8"])
def test_a_quantized_model_is_not_told_to_quantize_again(precision):
    memory = classify(Evidence(**UNDER_MEMORY, precision=precision)).next_step
    compute = classify(Evidence(**{**UNDER_MEMORY, "roof": "compute"}, precision=precision,
                                faster_kinds={"bf16": 2.0})).next_step
    overhead = [classify(Evidence(**{**UNDER_MEMORY, "overhead_share": 0.7}, precision=precision)).next_step,
                classify(Evidence(**{**UNDER_MEMORY, "roof_fraction": 0.02}, precision=precision)).next_step]
    for step in (memory, compute, *overhead):
        assert "--quantization w8a8" not in step, step
        if precision == "w4a8":
            assert "w8a8" not in step, step
    held = "the file's 4- to 8-bit blocks (w4a8" if precision == "w4a8" else "w8a8"
    assert f"already {held}" in memory
    assert "--precision w8a8" not in memory + compute and "--dtype bf16 --quantization none" in compute
    if precision == "w4a8":  # no artifact holds w4a8: compiling would change what is served
        assert all("builds no w4a8 artifact" in step and "--backend" not in step for step in overhead)
    else:  # compiling keeps the precision and fuses the ops
        assert all("compile it in the same precision" in step for step in overhead)


def test_a_w8a8_gguf_is_told_what_its_own_blocks_would_read():
    """The advice names this file's W4A8 bytes where they are known: worth it at <= 0.9x, not above."""
    fewer = classify(Evidence(**UNDER_MEMORY, precision="w8a8", w4a8_bytes_ratio=0.74)).next_step
    assert "this file's own blocks, `--quantization w4a8`, read 0.74x" in fewer
    close = classify(Evidence(**UNDER_MEMORY, precision="w8a8", w4a8_bytes_ratio=0.94)).next_step
    assert "would read 0.94x of that in w4a8: not enough" in close and "--quantization w4a8" not in close
    unknown = classify(Evidence(**UNDER_MEMORY, precision="w8a8")).next_step
    assert "a GGUF of 4- or 5-bit blocks" in unknown


def test_a_float_model_is_told_how_its_own_configuration_quantizes():
    loaded = classify(Evidence(**UNDER_MEMORY, precision="fp32")).next_step
    assert "`--quantization w8a8`" in loaded and "ladder compile" not in loaded
    artifact = classify(Evidence(**UNDER_MEMORY, precision="fp32", is_artifact=True)).next_step
    assert "`ladder compile --precision w8a8`" in artifact


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory):
    directory = tmp_path_factory.mktemp("doctor-w4a8")
    write_gguf(make_hf_model("llama3", directory / "hf"), directory / "m.gguf", "Q4_1", qtypes={"output": "Q8_0"})
    return directory / "m.gguf"


def test_the_step_breakdown_of_a_w4a8_model(q4_gguf, tmp_path, capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on two shared cores spin against the other processes
    try:
        code = main(["doctor", "--model", str(q4_gguf), "--quantization", "w4a8", "--kv-cache-dtype", "bfloat16",
                     "--max-num-seqs", "1",
                     "--num-requests", "1", "--input-len", "16", "--output-len", "8", "--max-prefill", "32",
                     "--out", str(tmp_path), "--quiet"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert code == 0
    assert "quantization   w4a8 (--quantization w4a8" in out and "w4a8 linears swapped in at load" in out
    assert "one decode step at batch 1, w4a8" in out and "roofline floor" in out
    report = json.loads((tmp_path / "doctor.json").read_text())
    assert report["model"]["quantization"] == {"asked": "w4a8", "resolved": "w4a8"}
    assert report["model"]["precision"] == "w4a8"
    config = report["model"]["config"]  # the bfloat16 cache: 2 bytes a key or value element
    assert report["model"]["kv_bytes_per_token"] == 2 * config["num_layers"] * config["num_kv_heads"] * config["head_dim"] * 2
    assert "w8a8" not in report["verdict"]["next_step"]

    b = report["step_breakdown"]
    phases = {p["name"]: p for p in b["phases"]}
    # Rows: every op the decoder runs, the engine's phases, and the two Python remainders.
    linear_attention = {"linear_in", "linear_out"}  # (Qwen3.5's layers: the test below)
    assert set(phases) == {*LINEAR_KINDS.values(), "attention", "attention plan", "rms_norm", "rotary",
                           "silu_and_mul", "embedding", "forward python", "schedule", "prepare", "sample",
                           "detokenize", "step python"} - linear_attention
    assert sum(p["seconds"] for p in b["phases"]) == pytest.approx(b["step_seconds"], rel=1e-9)
    assert b["python_dispatch_seconds"] == pytest.approx(
        phases["forward python"]["seconds"] + phases["step python"]["seconds"])
    # Within each instrumented step the timed ops are disjoint parts of the forward: none is counted twice.
    assert 0.2 < b["coverage"] <= 1.0
    # The layers ran as one C++ call (model/cpu_step.py), timed inside it under the same rows.
    assert any("one C++ call" in note for note in b["notes"])
    assert all(p["seconds"] > 0 for name, p in phases.items() if "python" not in name)
    # 2 layers; 2 norms a layer and the final one; cos/sin once a step and the rotation per layer.
    assert {k: phases[k]["calls"] for k in ("qkv", "down", "lm_head", "rms_norm", "rotary", "detokenize")} == \
        {"qkv": 2, "down": 2, "lm_head": 1, "rms_norm": 5, "rotary": 3, "detokenize": 1}
    # Q4_1 blocks: 20 bytes per 32 weights, the Q8_0 head 34; hidden 64, q 64 + k, v 32 each, intermediate
    # 128, vocabulary 320. The model's line counts the same bytes (not a flat size per w4a8 weight).
    expected = {"qkv": 2 * 128 * 64 * 20, "o": 2 * 64 * 64 * 20, "gate_up": 2 * 256 * 64 * 20,
                "down": 2 * 64 * 128 * 20, "lm_head": 320 * 64 * 34}
    assert {k: phases[k]["weight_bytes"] for k in expected} == {k: v // 32 for k, v in expected.items()}
    assert report["model"]["weight_bytes"] == pytest.approx(b["weight_bytes"])
    for kind in expected:
        assert phases[kind]["bytes_per_s"] == pytest.approx(phases[kind]["weight_bytes"] / phases[kind]["seconds"])
        assert phases[kind]["fraction_of_copy_bandwidth"] == pytest.approx(
            phases[kind]["bytes_per_s"] / b["memory_bandwidth"])
    assert b["roofline_floor_seconds"] == pytest.approx(b["weight_bytes"] / b["memory_bandwidth"])
    assert b["roofline_floor_fraction"] == pytest.approx(b["roofline_floor_seconds"] / b["step_seconds"])
    assert b["sse_chunk_seconds"] > 0 and b["num_steps"] >= 8


def test_the_step_breakdown_of_a_mixture_of_experts(tmp_path, capsys):
    """Qwen3-MoE's sparse layers: one row for each block (router, routing and the token's k experts), with
    the bytes a token reads of it; the dense middle layer's MLP under the linear rows."""
    write_gguf(make_hf_model("qwen3_moe", tmp_path / "hf"), tmp_path / "m.gguf", "Q4_0", "qwen3moe")
    code = main(["doctor", "--model", str(tmp_path / "m.gguf"), "--max-num-seqs", "1", "--num-requests", "1",
                 "--input-len", "16", "--output-len", "8", "--max-prefill", "32", "--out", str(tmp_path), "--quiet"])
    out = capsys.readouterr().out
    assert code == 0 and "MoE router + k experts" in out
    report = json.loads((tmp_path / "doctor.json").read_text())
    assert report["model"]["quantization"] == {"asked": "auto", "resolved": "w4a8"}
    phases = {p["name"]: p for p in report["step_breakdown"]["phases"]}
    assert phases["experts"]["calls"] == 2 and phases["gate_up"]["calls"] == 1 and phases["experts"]["seconds"] > 0
    # Hidden 64, 8 experts of 32, top 2, Q4_0 in the W4A8 layout: per expert gate/up 4 blocks of 16 rows x 2
    # 32-blocks (256 bytes of codes, 32 of scales each), down 4 x 1; the float32 router 8 x 64.
    per_expert = 4 * 2 * (256 + 32) + 4 * 1 * (256 + 32)
    assert phases["experts"]["weight_bytes"] == 2 * (8 * 64 * 4 + per_expert * 8 * 2 // 8)
    # The model line counts the same bytes: float routers and W4A8 experts each at their own size.
    assert report["model"]["weight_bytes"] == pytest.approx(report["step_breakdown"]["weight_bytes"])


def test_the_step_breakdown_of_linear_attention(tmp_path, capsys):
    """Qwen3.5 (two linear-attention layers, two of attention): the sweeps and the load run with state slots, and
    every linear weight is counted once. Its layers run as one C++ call, the linear attention's projections in the
    qkv and o rows, Qwen3.5-MoE's shared expert in the experts' row; float layers (no step) have rows of their own
    for the projections and the state update."""
    from tiny_models import QWEN3_5, QWEN3_5_MOE, hf_config, write_qwen35_gguf

    for family, quantization in ((QWEN3_5, "auto"), (QWEN3_5_MOE, "auto"), (QWEN3_5, "none")):
        config = hf_config(family)
        config.linear_value_head_dim = 16  # as llama.cpp's files have them: value heads as wide as key heads
        write_qwen35_gguf(transformers.AutoModelForCausalLM.from_config(config), tmp_path / "m.gguf", "Q8_0")
        code = main(["doctor", "--model", str(tmp_path / "m.gguf"), "--max-num-seqs", "2", "--num-requests", "2",
                     "--input-len", "16", "--output-len", "8", "--max-prefill", "32", "--out", str(tmp_path),
                     "--quantization", quantization, "--quiet"])
        assert code == 0, capsys.readouterr()
        report = json.loads((tmp_path / "doctor.json").read_text())
        breakdown = report["step_breakdown"]
        phases = {p["name"]: p for p in breakdown["phases"]}
        assert report["model"]["weight_bytes"] == pytest.approx(breakdown["weight_bytes"])
        assert [p["label"] for p in report["compile"]["sweep"]][:2] == ["decode b=1", "decode b=2"]
        if quantization == "auto":
            assert "linear_in" not in phases and phases["qkv"]["calls"] == 4
            assert any("projections in the qkv and o rows" in note for note in breakdown["notes"])
        if family == QWEN3_5_MOE:  # the shared expert's linears read as the experts' part
            assert "gate_up" not in phases and phases["experts"]["calls"] == 4
            assert any("the shared expert in the experts' row" in note for note in breakdown["notes"])
        if quantization == "none":
            assert phases["linear_in"]["calls"] == phases["linear_out"]["calls"] == phases["gated delta"]["calls"] == 2
            assert phases["qkv"]["calls"] == 2 and phases["gated delta"]["seconds"] > 0
