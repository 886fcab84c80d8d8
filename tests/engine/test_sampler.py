"""The batched sampler on hand-made logits."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engine.request import Request
from engine.sampler import NON_FINITE_LOGITS, Sampler, argmax_rows
from engine.sampler_ref import FullSortSampler
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


def test_argmax_rows_is_torch_argmax_with_ties_nan_and_infinities():
    logits = torch.randn(6, 49152, generator=torch.Generator().manual_seed(3))
    logits[1, [7, 9000]] = 50.0  # a tie: the first index wins
    logits[2, 11] = float("nan")  # NaN counts as the maximum
    logits[3] = float("-inf")
    logits[3, 40000] = 0.0
    logits[4] = float("-inf")  # every token forbidden: index 0
    logits[5, 123] = float("inf")
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    assert torch.equal(argmax_rows(logits[:, ::2]), logits[:, ::2].argmax(dim=-1))  # strided rows
    assert torch.equal(argmax_rows(logits.double()), logits.double().argmax(dim=-1))  # other dtypes: torch's


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # NumPy's argmax, torch's
def test_greedy_rows_take_the_first_maximum_and_report_nan(dtype):
    """Greedy rows: the first index of the maximum (ties, +inf), a row all -inf gives token 0, and a row
    with a NaN is its request's failure."""
    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(5)).to(dtype)
    logits[1, [70, 9000]] = 50.0
    logits[2, 11] = float("nan")
    logits[3] = float("-inf")
    reqs = requests(*[SamplingParams(temperature=0)] * 4)
    out = Sampler()(logits, reqs)
    assert out.errors == [None, None, NON_FINITE_LOGITS, None]
    assert [out.token_ids[i] for i in (0, 1, 3)] == [int(logits[0].argmax()), 70, 0]


# --- The sampler against the full-sort algorithm it replaced (engine/sampler_ref.py) ------------------

VOCAB = 8192  # wide enough that top-p settles rows on short and on longer candidate lists, or sorts in full
SCALES = [0.3, 1.5, 2.5, 4.0, 8.0, 20.0]  # logit spreads from flat (the full sort) to peaked (a few tokens)


def random_logits(batch: int, gen: torch.Generator) -> torch.Tensor:
    """Rows from flat to peaked, some rounded to bfloat16 or to integers so that equal probabilities
    occur, also across a top-p cut."""
    rows = []
    for _ in range(batch):
        scale = SCALES[int(torch.randint(len(SCALES), (), generator=gen))]
        row = torch.randn(VOCAB, generator=gen) * scale
        kind = int(torch.randint(3, (), generator=gen))
        rows.append(row if kind == 0 else row.bfloat16().float() if kind == 1 else row.round())
    return torch.stack(rows)


def random_params(gen: torch.Generator, seeded: bool) -> SamplingParams:
    def pick(options):
        return options[int(torch.randint(len(options), (), generator=gen))]

    return SamplingParams(
        temperature=pick([0.0, 0.3, 0.7, 1.0, 1.5]), top_p=pick([1.0, 1.0, 0.999, 0.95, 0.9, 0.5, 0.1, 1e-6]),
        top_k=pick([0, 0, 1, 5, 50, 1000, 20_000, VOCAB, 100_000]), min_p=pick([0.0, 0.0, 0.01, 0.2]),
        seed=int(torch.randint(2**31, (), generator=gen)) if seeded else None, logprobs=pick([None, 3]),
    )


def test_seeded_draws_match_the_full_sort_sampler_row_by_row():
    """Mixed batches on the new sampler give each seeded request exactly the tokens and logprobs the
    full-sort sampler gives it alone, step after step (its own generator advances each step)."""
    gen = torch.Generator().manual_seed(7)
    for trial in range(8):
        reqs = requests(*[random_params(gen, seeded=True) for _ in range(1 + trial % 5)])
        ours, reference = Sampler(seed=trial), FullSortSampler(seed=trial)
        for _ in range(3):
            logits = random_logits(len(reqs), gen)
            out = ours(logits, reqs)
            for row, request in enumerate(reqs):
                alone = reference(logits[row:row + 1], [request])
                assert (out.token_ids[row], out.logprobs[row]) == (alone.token_ids[0], alone.logprobs[0]), \
                    (trial, row, request.params)


def test_unseeded_batches_match_the_full_sort_sampler():
    """Unseeded rows draw from the sampler's own generator in batch order: the same stream as before.
    (Every row uses top-p, or none does: before, a row with top_p 1 in a batch with another row's top-p
    also lost the tail tokens whose preceding mass rounds to 1 in float32; now it never does, so
    its draws no longer depend on its batch.)"""
    gen = torch.Generator().manual_seed(8)
    for trial in range(8):
        params = [random_params(gen, seeded=trial % 2 == 0) for _ in range(1 + trial % 5)]
        if trial % 3:
            params = [dataclasses.replace(p, top_p=1.0 if trial % 3 == 1 else min(p.top_p, 0.9)) for p in params]
        reqs = requests(*params)
        ours, reference = Sampler(seed=trial), FullSortSampler(seed=trial)
        for _ in range(3):
            logits = random_logits(len(reqs), gen)
            assert ours(logits, reqs) == reference(logits, reqs), (trial, params)


@pytest.mark.parametrize("rounding", ["none", "bfloat16", "integer"])
def test_top_p_keeps_exactly_what_a_full_sort_keeps(rounding):
    """At the default model's vocabulary, rows from flat (sorted in full) to peaked (settled on the first
    candidates), through rows that need a second, longer candidate list."""
    from engine.sampler import apply_top_p_

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 49_152, generator=gen) * torch.tensor(SCALES)[:, None]
    logits = {"none": logits, "bfloat16": logits.bfloat16().float(), "integer": logits.round()}[rounding]
    probs = torch.softmax(logits, dim=-1)
    top_p = [0.9, 0.3, 0.6, 0.9, 0.9, 0.05]  # nuclei of about 41,000, 1,000, 600, 360, 4 and 1 tokens
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= torch.tensor(top_p)[:, None]
    expected = probs.masked_fill(torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted), 0.0)
    ours = probs.clone()
    apply_top_p_(ours, list(range(6)), top_p)
    assert torch.equal(ours, expected)
    # Rows left out are untouched.
    ours = probs.clone()
    apply_top_p_(ours, [1, 4], [top_p[1], top_p[4]])
    assert torch.equal(ours[[1, 4]], expected[[1, 4]]) and torch.equal(ours[[0, 2, 3, 5]], probs[[0, 2, 3, 5]])
