"""The sampler is total: every parameter value SamplingParams accepts, alone or mixed in one batch, gives
each row a token id in range and finite logprobs, and an extreme row never changes an ordinary row's
token. A row that cannot be sampled fails alone."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.request import Request
from engine.sampler import NON_FINITE_LOGITS, SAMPLING_FAILED, Sampler
from engine.sampler_ref import FullSortSampler
from engine.sampling_params import MAX_LOGPROBS, SamplingParams

EOS = 3


def unit_floats(low: float, high: float, exclude_min: bool = False) -> st.SearchStrategy[float]:
    """Any float in range, with the bounds, subnormals and the tiniest values drawn often."""
    edges = [x for x in (low, high, 5e-324, 1e-300, 1e-45, 1e-38, 1e-5, 1.0 - 1e-16, -1e-300)
             if low <= x <= high and not (exclude_min and x == low)]
    return st.one_of(st.sampled_from(edges), st.floats(low, high, exclude_min=exclude_min, allow_subnormal=True))


extreme_params = st.builds(
    SamplingParams,
    max_tokens=st.just(64),
    min_tokens=st.integers(0, 64),
    temperature=unit_floats(0.0, 2.0),
    top_p=unit_floats(0.0, 1.0, exclude_min=True),
    top_k=st.one_of(st.integers(-1, 70), st.integers(0, 2**63)),
    min_p=unit_floats(0.0, 1.0),
    presence_penalty=unit_floats(-2.0, 2.0),
    frequency_penalty=unit_floats(-2.0, 2.0),
    repetition_penalty=unit_floats(0.0, 2.0, exclude_min=True),
    seed=st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)),
    logprobs=st.one_of(st.none(), st.integers(0, MAX_LOGPROBS)),
    stop_token_ids=st.lists(st.integers(0, 36), max_size=3),
)
# Ordinary rows are the ones whose tokens must not depend on their batch: greedy or seeded.
ordinary_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    top_p=st.sampled_from([1.0, 0.9]),
    top_k=st.sampled_from([0, 20]),
    min_p=st.sampled_from([0.0, 0.05]),
    seed=st.integers(0, 2**32),
    logprobs=st.one_of(st.none(), st.just(2)),
)


def make_request(index: int, params: SamplingParams, prompt: list[int], output: list[int]) -> Request:
    request = Request(f"r{index}", prompt, params, eos_token_ids=frozenset({EOS}))
    request.output_token_ids = list(output)
    return request


@st.composite
def batches(draw):
    vocab = draw(st.sampled_from([37, 300, 2048]))
    scale = draw(st.sampled_from([1.0, 30.0, 1e30, 3e38]))  # model logits, up to float32's edge
    rows = draw(st.lists(st.tuples(st.booleans(), extreme_params, ordinary_params), min_size=1, max_size=6))
    requests, ordinary = [], []
    for i, (is_extreme, extreme, plain) in enumerate(rows):
        prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=8))
        output = draw(st.lists(st.integers(0, vocab - 1), max_size=8))
        requests.append(make_request(i, extreme if is_extreme else plain, prompt, output))
        if not is_extreme:
            ordinary.append(i)
    seed = draw(st.integers(0, 2**31))
    logits = (torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed)) * scale).clamp(
        -3.4e38, 3.4e38)
    return logits, requests, ordinary


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batches())
def test_mixed_batches_of_extreme_and_ordinary_rows(batch):
    logits, requests, ordinary = batch
    vocab = logits.shape[1]
    out = Sampler(seed=5)(logits, requests)
    assert not any(out.errors), out.errors
    assert all(0 <= t < vocab for t in out.token_ids)
    for request, token, logprobs in zip(requests, out.token_ids, out.logprobs):
        if len(request.output_token_ids) < request.params.min_tokens:
            assert token != EOS and token not in request.params.stop_token_ids
        if request.params.logprobs is None:
            assert logprobs is None
            continue
        assert logprobs.token_id == token and math.isfinite(logprobs.logprob)
        assert len(logprobs.top) == min(request.params.logprobs, vocab)
        assert all(0 <= t < vocab and math.isfinite(lp) for t, lp in logprobs.top)
    for i in ordinary:  # alone, with a sampler of its own: the same token and logprobs
        alone = Sampler(seed=99)(logits[i:i + 1], [requests[i]])
        assert alone.token_ids[0] == out.token_ids[i]
        assert alone.logprobs[0] == out.logprobs[i]


@settings(max_examples=60, deadline=None)
@given(batches())
def test_the_full_sort_reference_agrees_on_extreme_rows(batch):
    logits, requests, _ = batch
    seeded = [make_request(i, r.params.replace(seed=r.params.seed if r.params.seed is not None else i),
                           r.prompt_token_ids, r.output_token_ids) for i, r in enumerate(requests)]
    assert Sampler()(logits, seeded).token_ids == FullSortSampler()(logits, seeded).token_ids


def test_the_reported_requests_sample_a_likely_token():
    """repetition_penalty 1e-300 (0 in float32) crashed the sampler; top_p 1e-50 took the last token."""
    logits = torch.randn(3, 49152, generator=torch.Generator().manual_seed(0))
    requests = [make_request(0, SamplingParams(top_p=0.9, repetition_penalty=1e-300), [5, 6, 7], []),
                make_request(1, SamplingParams(top_p=1e-50), [5], []),
                make_request(2, SamplingParams(top_p=1e-50, temperature=2.0, seed=1), [5], [])]
    out = Sampler()(logits, requests)
    assert out.token_ids[1:] == logits[1:].argmax(dim=-1).tolist()  # a nucleus too small keeps the top token
    # Divided by ~0, every seen token with a positive logit is infinitely likely; one of them is drawn.
    assert out.token_ids[0] in [t for t in (5, 6, 7) if logits[0, t] > 0]


def test_a_row_that_fails_alone_ends_alone():
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(1))
    plain = [make_request(0, SamplingParams(temperature=0.8, seed=3), [1, 2], []),
             make_request(2, SamplingParams(temperature=0.0, logprobs=1), [4], [])]
    # A generated id outside the vocabulary makes the penalty's index_add raise: a fault in this row only.
    bad = make_request(1, SamplingParams(frequency_penalty=1.0), [1], [10**6])
    out = Sampler()(logits, [plain[0], bad, plain[1]])
    assert out.errors == [None, SAMPLING_FAILED, None]
    solo = [Sampler()(logits[i:i + 1], [r]) for i, r in ((0, plain[0]), (2, plain[1]))]
    assert [out.token_ids[0], out.token_ids[2]] == [s.token_ids[0] for s in solo]
    assert out.logprobs[2] == solo[1].logprobs[0]


@pytest.mark.parametrize("temperature", [0.0, 0.8])  # the greedy fast path and the sampled path
def test_a_row_of_nan_logits_is_its_requests_failure(temperature):
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(2))
    logits[1, 17] = float("nan")
    logits[2, 4] = float("inf")  # infinite but not NaN: clamped and sampled
    params = [SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=temperature, logprobs=1),
              SamplingParams(temperature=temperature, seed=1, logprobs=1), SamplingParams(temperature=0.0)]
    requests = [make_request(i, p, [1], []) for i, p in enumerate(params)]
    out = Sampler()(logits, requests)
    assert out.errors == [None, NON_FINITE_LOGITS, None, None]
    assert out.token_ids[0] == int(logits[0].argmax()) and out.token_ids[2] == 4
    assert out.token_ids[3] == int(logits[3].argmax())
    assert out.logprobs[1] is None and math.isfinite(out.logprobs[2].logprob)
