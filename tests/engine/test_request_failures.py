"""A failure is the request's own: when building one request's inputs, sampling its row or turning its
token into text raises, that request ends with an error and the others of the step keep their tokens; the
engine counts no step failure. Extreme sampling values run in a batch without hurting anyone."""

from __future__ import annotations

import pytest

from engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from engine.llm_engine import OUTPUT_FAILED, PREPARE_FAILED
from engine.sampler import SAMPLING_FAILED

PROMPTS = [[1, 5, 9, 14, 3, 2], [7, 7, 8], [20, 21, 22, 23, 24, 25, 26, 27], [4, 40]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tiny_dir):
    from model.loader import load

    return load(str(tiny_dir))


def make_engine(loaded) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_memory_gib=0.01, max_model_len=128, max_num_seqs=8), loaded=loaded)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], before_steps=None) -> dict:
    """Every request to its end: id -> (token ids, finish reason, error). `before_steps(engine)` runs once
    the requests are queued."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    if before_steps is not None:
        before_steps(engine)
    tokens: dict[str, list[int]] = {r: [] for r in requests}
    ends: dict[str, tuple] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
            if delta.finished:
                ends[delta.request_id] = (delta.finish_reason, delta.error)
    return {r: (tokens[r], *ends[r]) for r in requests}


@pytest.fixture(scope="module")
def solo(loaded):
    engine = make_engine(loaded)
    return {str(i): run(engine, {str(i): (p, GREEDY)})[str(i)] for i, p in enumerate(PROMPTS)}


def assert_solo(results: dict, solo: dict, skip: str) -> None:
    for request_id, result in results.items():
        if request_id != skip:
            assert result == solo[request_id], request_id


def test_extreme_sampling_values_share_a_batch_with_greedy_requests(loaded, solo):
    engine = make_engine(loaded)
    extreme = {"x1": (PROMPTS[0], SamplingParams(top_p=0.9, repetition_penalty=1e-300, max_tokens=8)),
               "x2": (PROMPTS[1], SamplingParams(top_p=1e-50, temperature=2.0, min_p=1.0, presence_penalty=-2.0,
                                                 frequency_penalty=2.0, top_k=2**62, seed=2**64 - 1, n=3,
                                                 logprobs=20, max_tokens=8)),
               "x3": (PROMPTS[2], SamplingParams(temperature=1e-5, repetition_penalty=5e-324, logprobs=0,
                                                 max_tokens=8))}
    results = run(engine, {**{str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)}, **extreme})
    assert_solo({k: v for k, v in results.items() if not k.startswith("x")}, solo, skip="")
    for request_id in extreme:
        assert results[request_id][1] in (FinishReason.STOP, FinishReason.LENGTH), results[request_id]
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_row_whose_sampling_raises_ends_alone(loaded, solo, monkeypatch):
    engine = make_engine(loaded)
    real = engine.sampler._sample

    def fails_for_request_2(logits, requests, uniform, masks=None):
        if any(r.parent_id == "2" for r in requests):
            raise RuntimeError("injected sampling fault")
        return real(logits, requests, uniform, masks)

    monkeypatch.setattr(engine.sampler, "_sample", fails_for_request_2)
    results = run(engine, {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)})
    assert results["2"] == ([], FinishReason.ERROR, SAMPLING_FAILED)
    assert_solo(results, solo, skip="2")
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_request_whose_text_stream_raises_ends_alone(loaded, solo):
    def break_stream_of_request_1(engine: LLMEngine) -> None:
        def broken_push(token_id: int) -> str:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

        next(s for r, s in engine.streams.items() if r.parent_id == "1").push = broken_push

    engine = make_engine(loaded)
    results = run(engine, {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)}, break_stream_of_request_1)
    assert results["1"][1:] == (FinishReason.ERROR, OUTPUT_FAILED)
    assert_solo(results, solo, skip="1")
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_request_whose_inputs_fail_to_build_ends_alone(loaded, solo, monkeypatch):
    engine = make_engine(loaded)
    real = engine.runner.prepare

    def fails_with_request_3(batch):
        if any(item.request.parent_id == "3" for item in batch.scheduled):
            raise IndexError("injected prepare fault")
        return real(batch)

    monkeypatch.setattr(engine.runner, "prepare", fails_with_request_3)
    results = run(engine, {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)})
    assert results["3"] == ([], FinishReason.ERROR, PREPARE_FAILED)
    assert_solo(results, solo, skip="3")
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
