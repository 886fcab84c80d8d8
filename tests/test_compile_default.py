"""`ladder compile` on the embedded default model (SmolLM2-135M): the parity bounds of issue 7 on a real
model, and its artifact served through the engine.

Each compile loads the model, measures fp32 eager, compiles and verifies (two to four minutes on two
cores), so the suite compiles the two INT8 torch-compile artifacts of the default model, the ones
furthest from fp32: weight-only `int8`, and `w8a8` (int8 activations too, after SmoothQuant), the
fastest here. Every backend and precision is compiled by
`bash benchmarks/compile_matrix.sh`, whose table is recorded in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import pytest

from compile.pipeline import CompileOptions, run
from engine.llm import LLM
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module", params=["int8", "w8a8"])
def int8_artifact(request, tmp_path_factory):
    out, manifest = run(CompileOptions(model=None, backend="torch-compile", precision=request.param,
                                       out=tmp_path_factory.mktemp("default") / request.param, max_model_len=1024,
                                       max_num_seqs=16, run_bench=False))
    return out, manifest


def test_int8_perplexity_within_two_percent(int8_artifact):
    report = int8_artifact[1].parity
    assert report["perplexity_tokens"] == 2048
    assert 0 <= abs(report["perplexity_change"]) <= 0.02, report
    # Given the same context, INT8 picks eager's best token almost always (free-running greedy drifts
    # after the first close call, so its count is reported, not bounded).
    assert report["teacher_forced_top1_agreement"] >= 0.9, report


def test_int8_artifact_batched_equals_alone(int8_artifact):
    out, _ = int8_artifact
    llm = LLM(artifact=str(out), kv_cache_memory_gib=0.05)
    prompts = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers:",
               "def add(a, b):"]
    params = SamplingParams(temperature=0, max_tokens=24)
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    together = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    assert together == alone
    # fp32 eager puts " Paris" 2.5 logits ahead here; the artifact must keep a choice that clear. (Asked as
    # a chat question, fp32's own first token is a near tie, 0.08 logits, which any rounding may flip.)
    text = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].text
    assert text.startswith(" Paris")
    reply = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(temperature=0, max_tokens=16)).outputs[0]
    assert reply.text.strip() and reply.finish_reason in ("stop", "length")
