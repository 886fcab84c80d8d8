"""`ladder doctor`: the verdict's rules on given figures, the cost model against real modules, and three
real runs on tiny models that force a bound each (overhead at batch 1, compute at a large batch, queue
under a flood with one sequence slot), plus one run against a live server over HTTP."""

from __future__ import annotations

import json

import pytest
import torch

from doctor.config import DoctorConfig
from doctor.cost import ModelCost
from doctor.local import run_local
from doctor.verdict import Evidence, classify
from ladder.cli import main
from model.precision import PRECISIONS
from model.quantization import resolve_quantization

# ---- the rules, on figures ---------------------------------------------------------------------------

UNDER_MEMORY = dict(queue_share=0.05, overhead_share=0.1, roof_fraction=0.6, roof="memory", weight_bytes=5.4e8)


def test_each_bound_follows_from_its_figures():
    memory = classify(Evidence(**UNDER_MEMORY))
    assert memory.bound == "memory" and "--speculative-tokens" in memory.next_step  # the one-stream lever
    assert classify(Evidence(**{**UNDER_MEMORY, "roof": "compute"})).bound == "compute"
    assert classify(Evidence(**{**UNDER_MEMORY, "queue_share": 0.7})).bound == "queue"
    assert classify(Evidence(**{**UNDER_MEMORY, "overhead_share": 0.6})).bound == "overhead"
    # A forward the roofline explains a twentieth of is dispatch, whatever roof it sits under.
    assert classify(Evidence(**{**UNDER_MEMORY, "roof_fraction": 0.05})).bound == "overhead"
    split = Evidence(**{**UNDER_MEMORY, "num_ranks": 2, "communication_share": 0.4})
    assert classify(split).bound == "communication"
    # One rank never talks to another, whatever the figure says.
    assert classify(Evidence(**{**UNDER_MEMORY, "communication_share": 0.9})).bound == "memory"


def test_the_layers_are_judged_top_down():
    # Waiting for a slot outranks a slow step: the user sees the queue first.
    everything = Evidence(**{**UNDER_MEMORY, "queue_share": 0.8, "overhead_share": 0.9, "roof_fraction": 0.05})
    assert classify(everything).bound == "queue"
    assert classify(Evidence(**{**UNDER_MEMORY, "queue_share": 0.8, "num_ranks": 4,
                                "communication_share": 0.5})).bound == "communication"


def test_the_next_step_follows_the_numbers():
    full = classify(Evidence(queue_share=0.8, occupancy=1.0, max_num_seqs=4, roof_fraction=0.5, roof="memory"))
    assert "--max-num-seqs above 4" in full.next_step and "4.0 of --max-num-seqs 4" in full.reasons[1]
    preempted = classify(Evidence(queue_share=0.8, occupancy=0.5, max_num_seqs=4, num_preemptions=3))
    assert "--kv-cache-memory" in preempted.next_step and "3 preemptions" in preempted.reasons[-1]
    faster = classify(Evidence(**{**UNDER_MEMORY, "roof": "compute", "precision": "fp32",
                                  "faster_kinds": {"int8": 4.0, "bf16": 0.8}}))
    assert "w8a8" in faster.next_step and "4.0x" in faster.next_step
    assert "GPU" in classify(Evidence(**{**UNDER_MEMORY, "roof": "compute"})).next_step
    assert "540 MB" in classify(Evidence(**UNDER_MEMORY)).next_step
    overhead = {**UNDER_MEMORY, "overhead_share": 0.6, "precision": "w8a8"}
    assert "ladder compile --backend torch-compile" in classify(Evidence(**overhead)).next_step
    eager_only = classify(Evidence(**overhead, compilable=False)).next_step  # Gemma 3's two windows
    assert "ladder compile --backend" not in eager_only and "one attention window" in eager_only


def test_no_measured_step_is_an_error_not_a_guess():
    with pytest.raises(ValueError, match="no step was measured"):
        classify(Evidence(queue_share=0.1, overhead_share=0.1))


def test_doctor_config_rejects_two_sources_and_bad_sizes():
    with pytest.raises(ValueError, match="give one of"):
        DoctorConfig(model="m", base_url="http://x")
    with pytest.raises(ValueError, match="--max-num-seqs must be at least 1"):
        DoctorConfig(max_num_seqs=0)


# ---- real runs ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Two threads of torch on two shared cores spin against every other process; one measures steadily.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llama_dir(tiny_hf_dir):
    return tiny_hf_dir("llama3")


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """Wide enough that a batch of 64 is real matmul work (2 x 8.4 M parameters), small enough to load fast."""
    import transformers

    directory = tmp_path_factory.mktemp("doctor") / "wide"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=512, intermediate_size=2048, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory, safe_serialization=True)
    return directory


def test_the_cost_model_counts_the_modules_parameters(wide_dir, llama_dir):
    import model

    for directory in (wide_dir, llama_dir):
        loaded = model.load(str(directory))
        cost = ModelCost(loaded.config, "fp32", 4)
        assert cost.num_params == sum(p.numel() for p in loaded.module.parameters())
        assert cost.kv_bytes_per_token == 2 * loaded.config.num_layers * loaded.config.kv_size * 4
    # Weights are read once a step: batch 64 reads them once and does 64 times the matmul work.
    one, many = cost.decode_step(1, 16), cost.decode_step(64, 16)
    assert many.flops == pytest.approx(64 * one.flops)
    assert many.bytes - one.bytes == pytest.approx(63 * 17 * cost.kv_bytes_per_token)


def test_the_cost_model_reads_the_experts_a_step_reaches(tmp_path):
    """A mixture of experts: every expert counted as a parameter; a one-token step reads its router and k
    of E experts a layer, a large batch nearly all E; each token multiplies k."""
    import model
    from tiny_models import make_hf_model

    make_hf_model("mixtral", tmp_path / "moe")
    loaded = model.load(str(tmp_path / "moe"))
    c = loaded.config
    cost = ModelCost(c, "fp32", 4)
    assert cost.num_params == sum(p.numel() for p in loaded.module.parameters())
    attention = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
    expert = 3 * c.hidden_size * c.moe_intermediate_size
    router = c.num_experts * c.hidden_size
    layers = lambda experts: c.num_layers * (attention + router + experts * expert)  # noqa: E731
    assert cost.weight_bytes == pytest.approx((layers(c.num_experts_per_tok) + cost.head_params) * 4)
    assert cost.step_weight_bytes(1000) == pytest.approx((layers(c.num_experts) + cost.head_params) * 4)
    assert cost.layer_matmul_params == layers(c.num_experts_per_tok)
    assert cost.decode_step(64, 16).flops == pytest.approx(64 * cost.decode_step(1, 16).flops)


def test_a_tiny_model_at_batch_one_is_overhead_or_memory_bound(llama_dir):
    # 32 output tokens: with 8, the request's life was a few tens of milliseconds, and one pause of the process
    # (a busy neighbour on 2 cores) between its arrival and its first step read as a queue-bound verdict.
    report = run_local(DoctorConfig(model=str(llama_dir), max_num_seqs=1, num_requests=1, input_len=16, output_len=32,
                                    max_prefill=32))
    assert report.verdict.bound in ("overhead", "memory"), report.verdict
    assert report.load.queue_share < 0.5
    assert [p.label for p in report.sweep] == ["decode b=1", "prefill 16", "prefill 32"]
    # Batch 1 decode sits left of the ridge point: it reads every weight to do one multiply-add with it.
    # The model runs what `ladder serve` would: `--quantization auto` resolved for it here.
    assert report.quantization == ("auto", resolve_quantization("auto", "float32", "cpu", str(llama_dir)))
    decode, precision = report.sweep[0], PRECISIONS[report.cost.precision]
    assert decode.roof(report.machine, precision.matmul) == "memory"
    assert decode.cost.intensity <= 2 / precision.weight_bytes
    # The process's memory, itemized: the module's tensors (each storage once) and its KV cache inside the heap.
    memory = report.memory
    assert memory is not None and memory.resident >= memory.anonymous > 0
    assert sum(memory.weights.values()) > 0 and memory.kv_cache > 0
    assert set(memory.weights) <= {"embedding", "LM head", "attention", "MLP / experts", "other"}
    assert memory.anonymous >= sum(memory.weights.values()) + memory.kv_cache and memory.peak >= memory.resident


def test_a_large_batch_is_compute_bound(wide_dir):
    # 64 prompts of 32 tokens fill one 2,048-token step: real matmul work, at most a second of it.
    report = run_local(DoctorConfig(model=str(wide_dir), max_num_seqs=64, input_len=32, output_len=4,
                                    max_prefill=64))
    assert report.verdict.bound == "compute", (report.verdict, report.operating)
    assert report.load.occupancy == pytest.approx(1.0)
    assert report.operating.roof == "compute" and report.operating.fraction >= 0.1
    assert "compute" in report.verdict.reasons[0]


def test_a_flood_with_one_slot_is_queue_bound_and_the_cli_writes_the_plot(llama_dir, tmp_path, capsys):
    out = tmp_path / "doctor"
    code = main(["doctor", "--model", str(llama_dir), "--max-num-seqs", "1", "--num-requests", "8", "--input-len", "16",
                 "--output-len", "8", "--max-prefill", "32", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0
    assert "verdict: QUEUE bound" in captured.out and "--max-num-seqs above 1" in captured.out
    for layer in ("1 model", "2 parallelism", "3 runtime", "4 compile", "5 hardware", "6 memory"):
        assert layer in captured.out
    assert "decode sweep: batch 1" in captured.err  # progress while it measures
    report = json.loads((out / "doctor.json").read_text())
    assert report["verdict"]["bound"] == "queue" and report["runtime"]["queue_share"] >= 0.5
    assert report["runtime"]["num_requests"] == 8 and report["runtime"]["generation_tokens"] == 64
    assert report["memory"]["resident"] > 0 and report["memory"]["rest"] >= 0
    assert (out / "roofline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_cli_says_what_is_wrong_in_one_line(capsys):
    assert main(["doctor", "--model", "/nonexistent", "--base-url", "http://127.0.0.1:9"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("ladder doctor: error: give one of") and "\n" not in err


# ---- a live server -------------------------------------------------------------------------------------


def test_doctor_reads_a_running_server_over_http(tiny_dir, tmp_path):
    import httpx

    from in_process_server import InProcessServer, make_state

    server = InProcessServer(make_state(tiny_dir, max_num_seqs=1))
    url = server.url
    try:
        stats = httpx.get(url + "/stats").json()
        assert stats["model"]["max_num_seqs"] == 1 and stats["model"]["config"]["hidden_size"] == 32
        assert stats["model"]["precision"] == "fp32" and stats["engine"]["num_running"] == 0
        assert stats["model"]["kv_cache_dtype"] == "float32"
        assert httpx.get(url + "/").text.startswith("<!doctype html>")
        assert httpx.get(url + "/static/app.py").status_code == 404  # only the page's own files
        code = main(["doctor", "--base-url", url, "--num-requests", "6", "--input-len", "16", "--output-len", "8",
                     "--max-prefill", "32", "--out", str(tmp_path / "out"), "--quiet"])
        assert code == 0
        report = json.loads((tmp_path / "out" / "doctor.json").read_text())
        assert report["verdict"]["bound"] == "queue"  # six requests at once, one slot
        assert report["runtime"]["source"] == url and report["runtime"]["generation_tokens"] >= 48
        assert report["compile"]["load"][0]["phase"] == "load"
        after = httpx.get(url + "/stats").json()
        assert after["engine"]["num_generation_tokens"] >= 48 and after["latency"]["ttft"]["count"] >= 6
    finally:
        server.stop()
