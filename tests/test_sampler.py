"""The batched sampler on hand-made logits."""

from __future__ import annotations

import math

import torch

from engine.request import Request
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams


def requests(*params: SamplingParams, outputs=None) -> list[Request]:
    reqs = [Request(f"r{i}", [0, 1], p, eos_token_ids=frozenset({3})) for i, p in enumerate(params)]
    for r, out in zip(reqs, outputs or []):
        r.output_token_ids = list(out)
    return reqs


def test_greedy_and_degenerate_filters_pick_the_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(top_p=1e-6),
              SamplingParams(min_p=1.0), SamplingParams(temperature=0, top_k=3)]
    out = Sampler()(logits, requests(*params))
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    sampler = Sampler(seed=1)
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[sampler(logits, requests(SamplingParams(temperature=1.0))).token_ids[0]] += 1
    freq = counts / counts.sum()
    assert torch.allclose(freq, torch.tensor([0.1, 0.2, 0.3, 0.4]), atol=0.03)


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.log(torch.tensor([[0.05, 0.15, 0.3, 0.5]])).repeat(3, 1)
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.6), SamplingParams(min_p=0.5)]
    sampler = Sampler(seed=2)
    seen = [set(), set(), set()]
    for _ in range(400):
        for row, token in enumerate(sampler(logits, requests(*params)).token_ids):
            seen[row].add(token)
    assert seen[0] == {2, 3}  # two best
    assert seen[1] == {2, 3}  # 0.5 alone is below 0.6
    assert seen[2] == {2, 3}  # at least half of the best token's probability


def test_seeded_request_is_reproducible_whatever_the_batch():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(3))
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [Sampler(seed=0)(logits, requests(seeded)).token_ids[0] for _ in range(1)]
    sampler = Sampler(seed=99)
    noise = torch.randn(2, 100)
    batch = torch.cat([noise[:1], logits, noise[1:]])
    others = SamplingParams(temperature=1.0)
    reqs = requests(others, seeded, others)
    first = sampler(batch, reqs).token_ids[1]
    assert first == alone[0]
    # And over several steps: a fresh sampler, the same seed, the same stream.
    a, b = Sampler(seed=5), Sampler(seed=6)
    ra, rb = requests(seeded), requests(others, seeded)
    for _ in range(20):
        assert a(logits, ra).token_ids[0] == b(torch.cat([noise[:1], logits]), rb).token_ids[1]


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[2.0, 1.0, -1.0, 1.5, 0.0]])
    rep = Sampler()(logits, requests(SamplingParams(temperature=0, repetition_penalty=2.0)))
    assert rep.token_ids == [3]  # prompt tokens 0 and 1 are penalized: 2.0 / 2 = 1.0 < 1.5
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5, 0.0]])
    freq = Sampler()(logits, requests(SamplingParams(temperature=0, frequency_penalty=1.0), outputs=[[0, 0]]))
    assert freq.token_ids == [1]  # 2.0 - 2 * 1.0 = 0
    pres = Sampler()(logits, requests(SamplingParams(temperature=0, presence_penalty=1.5), outputs=[[0, 0]]))
    assert pres.token_ids == [1]  # 2.0 - 1.5 = 0.5 < 1.0


def test_min_tokens_suppresses_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 0.0, 0.0, 10.0, 9.0]])  # 3 is EOS
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(4,))
    out = Sampler()(logits, requests(params, outputs=[[1]]))
    assert out.token_ids[0] not in (3, 4)
    done = Sampler()(logits, requests(params, outputs=[[1, 1]]))
    assert done.token_ids == [3]


def test_logprobs_of_chosen_and_best_tokens():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    out = Sampler()(logits, requests(SamplingParams(temperature=0, logprobs=2)))
    lp = out.logprobs[0]
    expected = torch.log_softmax(logits[0], dim=-1)
    assert lp.token_id == 1 and math.isclose(lp.logprob, expected[1].item(), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == [1, 2]
    assert math.isclose(lp.top[1][1], expected[2].item(), rel_tol=1e-6)
    assert Sampler()(logits, requests(SamplingParams(temperature=0))).logprobs == [None]


def test_out_of_range_top_k_and_tiny_temperature_are_safe():
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(4))
    out = Sampler()(logits, requests(SamplingParams(top_k=10_000), SamplingParams(temperature=1e-30)))
    assert 0 <= out.token_ids[0] < 10
    assert out.token_ids[1] == int(logits[1].argmax())
