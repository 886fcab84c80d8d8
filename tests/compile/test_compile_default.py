"""The default model (SmolLM2-135M) in its fast forms at load: W4A8 on the file's own Q4_1/Q8_0 blocks
(what `ladder serve` runs by default, no compile step) and W8A8 (after SmoothQuant), each against fp32
eager on the parity inputs, and served batched as alone. (Weight-only INT8 at load is checked on tiny
models in tests/model/test_w8a8.py.)

`ladder compile` runs the same modules through Inductor; a compile of the default model takes minutes
on two cores, so the suite compiles every torch-compile precision (W8A8 included) and the ONNX ones on a
tiny model (tests/compile/test_compile.py), which exercises the same paths. Every backend and precision of
the default model is compiled by `bash benchmarks/compile_matrix.sh`, whose table is recorded in
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import pytest

import model
from compile import parity
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from model.quantization import resolve_quantization

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers:",
           "def add(a, b):"]


@pytest.fixture(scope="module")
def fp32_reference(default_model):
    loaded = default_model  # read only: the session's one fp32 load, shared with the other files of this worker
    prompts, corpus = parity.encode_inputs(loaded.tokenizer, loaded.config.vocab_size)
    return parity.reference(loaded.module, prompts, corpus)


@pytest.fixture(scope="module", params=["w8a8", "w4a8"])
def at_load(request, fp32_reference):
    """The default model quantized at load as `--quantization` does it, and its parity report."""
    loaded = model.load(quantization=request.param)
    return loaded, parity.compare(loaded.module, fp32_reference).to_dict()


def check_parity(report: dict) -> None:
    assert report["perplexity_tokens"] == 2048
    assert 0 <= abs(report["perplexity_change"]) <= 0.02, report
    # Given the same context, INT8 picks eager's best token almost always (free-running greedy drifts
    # after the first close call, so its count is reported, not bounded).
    assert report["teacher_forced_top1_agreement"] >= 0.9, report


def check_serving(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=24)
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]
    together = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]
    assert together == alone
    # fp32 eager puts " Paris" 2.5 logits ahead here; int8 must keep a choice that clear. (Asked as a chat
    # question, fp32's own first token is a near tie, 0.08 logits, which any rounding may flip.)
    text = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].text
    assert text.startswith(" Paris")
    reply = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(temperature=0, max_tokens=16)).outputs[0]
    assert reply.text.strip() and reply.finish_reason in ("stop", "length")


def test_quantization_at_load_perplexity(at_load):
    loaded, report = at_load
    check_parity(report)
    if resolve_quantization("auto", "float32", "cpu") == loaded.quantization:
        # What serves by default must stay within +1% of fp32 (issue 13's bound for the default).
        assert report["perplexity_change"] <= 0.01, report


def test_quantization_at_load_serves_the_same_tokens_batched_as_alone(at_load):
    check_serving(LLM(loaded=at_load[0], kv_cache_memory_gib=0.05))
