"""Speculative decoding by prompt lookup (engine/speculative.py, Sampler.verify, the scheduler's drafts):
greedy text identical with and without drafts, sampled tokens distributed as plain sampling draws them,
stop conditions and max_tokens exact, drafts cut to the budget and dropped before a preemption, and the
prefix cache holding only verified tokens."""

from __future__ import annotations

import collections

import pytest
import torch

from engine.block_manager import KVBlockManager
from engine.llm import LLM
from engine.request import Request
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.speculative import NgramProposer, ngram_draft

# A prompt that repeats itself: the random model's continuation tends to loop, and lookups find drafts.
LOOP = [5, 6, 7, 8, 9, 10, 11, 12] * 6


def test_ngram_draft_takes_the_longest_most_recent_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 6, 7, 2, 3]
    # The tail [2, 3] occurs at 1 and 5; [7, 2, 3] nowhere before: the most recent 2-gram wins.
    assert ngram_draft(tokens, 3) == [4, 5, 6]
    assert ngram_draft(tokens, 1) == [4]
    # A longer match beats a more recent shorter one.
    tokens = [1, 2, 3, 4, 8, 9, 3, 4, 5, 1, 2, 3, 4]
    assert ngram_draft(tokens, 2, max_ngram=4) == [8, 9]
    assert ngram_draft([1, 2, 3, 4, 5], 3) == []  # nothing repeats
    assert ngram_draft([7, 7], 3) == []  # too short to match a 2-gram before its end


def test_proposer_respects_max_tokens_the_batch_bound_and_ineligible_requests():
    proposer = NgramProposer(default_tokens=4, max_batch=2)
    plain = Request("a", list(LOOP), SamplingParams(max_tokens=3, temperature=0))
    assert proposer.propose([plain], 1000)[plain] == [5, 6]  # 3 tokens left: 2 drafts and the model's own
    penalized = Request("b", list(LOOP), SamplingParams(max_tokens=50, repetition_penalty=1.2))
    opted_out = Request("c", list(LOOP), SamplingParams(max_tokens=50, speculative_tokens=0))
    assert proposer.propose([penalized, opted_out], 1000) == {}
    many = [Request(str(i), list(LOOP), SamplingParams(max_tokens=50)) for i in range(3)]
    assert proposer.propose(many, 1000) == {}  # three decoding sequences: over max_batch
    asked = Request("d", list(LOOP), SamplingParams(max_tokens=50, speculative_tokens=2))
    assert NgramProposer().propose([asked], 1000)[asked] == [5, 6]  # opt-in with the server's default off


def test_a_request_whose_drafts_fail_proposes_fewer():
    proposer = NgramProposer(default_tokens=8)
    request = Request("a", list(LOOP), SamplingParams(max_tokens=100))
    assert len(proposer.propose([request], 1000)[request]) == 8
    proposer.record(request, 8, 0)
    assert len(proposer.propose([request], 1000)[request]) == 4
    proposer.record(request, 4, 4)
    assert len(proposer.propose([request], 1000)[request]) == 8


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir), kv_cache_memory_gib=0.02, max_num_seqs=8, max_model_len=512)


def run(llm: LLM, prompts, params):
    return [out.outputs[0] for out in llm.generate(prompts, params)]


def test_greedy_text_is_the_same_with_drafts(llm):
    stats = llm.engine.stats
    prompts = [LOOP, LOOP[:20] + [3, 4], [40, 41, 42, 43] * 5]
    plain = run(llm, prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, speculative_tokens=0))
    before = (stats.num_draft_tokens, stats.num_accepted_tokens)
    drafted = run(llm, prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, speculative_tokens=5))
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert all(len(o.token_ids) == 40 for o in drafted)
    assert stats.num_draft_tokens > before[0] and stats.num_accepted_tokens > before[1]
    # Alone, each also matches (a batch of one speculates; three decoding sequences do too, max_batch 4).
    for prompt, expected in zip(prompts, plain):
        alone = run(llm, [prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                  speculative_tokens=5))
        assert alone[0].token_ids == expected.token_ids


def test_max_tokens_stop_tokens_and_logprobs_hold_with_drafts(llm):
    plain = run(llm, [LOOP], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0].token_ids
    for max_tokens in (1, 2, 7, 13):
        out = run(llm, [LOOP], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                              speculative_tokens=6))[0]
        assert out.token_ids == plain[:max_tokens] and out.finish_reason.value == "length"
    stop = plain[9]
    first = plain.index(stop)
    out = run(llm, [LOOP], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=(stop,),
                                          speculative_tokens=6))[0]
    assert out.token_ids == plain[:first + 1] and out.finish_reason.value == "stop"
    out = run(llm, [LOOP], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2,
                                          speculative_tokens=6))[0]
    reference = run(llm, [LOOP], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2))[0]
    assert [lp.token_id for lp in out.logprobs] == out.token_ids == reference.token_ids
    assert [lp.logprob for lp in out.logprobs] == pytest.approx([lp.logprob for lp in reference.logprobs], abs=1e-4)


def test_the_prefix_cache_holds_only_verified_tokens(llm):
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, speculative_tokens=8)
    first = run(llm, [LOOP], params)[0].token_ids
    # The prompt and the output of the first request, as a prompt: its blocks are found in the cache.
    hits = llm.engine.blocks.prefix_hits
    again = run(llm, [LOOP + first[:32]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids
    assert llm.engine.blocks.prefix_hits - hits >= 64
    assert again == first[32:40]


def sampled_tokens(probs: torch.Tensor, draft: tuple[int, ...], trials: int, seed: int) -> list[tuple[int, ...]]:
    """The tokens Sampler.verify gives for rows of `probs` [k + 1, V] (as logits: log p) and a draft."""
    sampler = Sampler(seed)
    request = Request("r", [1], SamplingParams(temperature=1.0, max_tokens=8))
    logits = probs.log()
    return [tuple(sampler.verify(logits, [request], [draft])[0].token_ids) for _ in range(trials)]


def test_sampled_verification_keeps_the_models_distribution():
    # Two positions over 4 tokens; the draft proposes token 1 then token 3.
    p = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.4, 0.1, 0.2, 0.3], [0.25, 0.25, 0.25, 0.25]])
    trials = 6000
    outcomes = sampled_tokens(p, (1, 3), trials, seed=0)
    first = collections.Counter(o[0] for o in outcomes)
    for token in range(4):  # the first token is distributed as p[0], whatever the draft
        assert abs(first[token] / trials - float(p[0, token])) < 0.025, (token, first)
    # Given the first draft kept, the second token is distributed as p[1].
    kept = [o for o in outcomes if o[0] == 1]
    second = collections.Counter(o[1] for o in kept)
    for token in range(4):
        assert abs(second[token] / len(kept) - float(p[1, token])) < 0.035, (token, second)
    assert all(len(o) == 3 for o in outcomes if o[:2] == (1, 3))  # both kept: one more token


def test_drafts_are_cut_to_the_budget_and_dropped_before_a_preemption():
    blocks = KVBlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=6, max_model_len=16), blocks)
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=8))
    b = Request("b", [4, 5, 6], SamplingParams(max_tokens=8))
    for request in (a, b):
        scheduler.add(request)
    scheduler.finish_step(scheduler.schedule())
    for request in (a, b):  # each has sampled a token: 4 tokens, 3 computed, one block each
        request.output_token_ids.append(9)
    out = scheduler.schedule({a: [7] * 6, b: [8, 8]})
    # a's token and 5 of its drafts fill the budget of 6; b waits for the next step.
    assert [(s.request, s.num_new_tokens, s.draft_token_ids) for s in out.scheduled] == [(a, 6, (7,) * 5)]
    scheduler.finish_step(out)
    assert a.num_computed_tokens == 4 and len(a.block_ids) == 3  # drafts count once accepted, not when run
    a.output_token_ids.append(7)  # one draft accepted (the engine's part), a decodes next
    # No block is free: b's drafts would need one more, so they are dropped and b decodes its one token.
    out = scheduler.schedule({b: [8, 8, 8, 8]})
    assert [(s.request, s.num_new_tokens, s.draft_token_ids) for s in out.scheduled] == [(a, 1, ()), (b, 1, ())]
    assert not out.preempted


@pytest.fixture(scope="module")
def other_tiny(tmp_path_factory):
    """A second tiny model of the same vocabulary, other weights: a draft model that is often wrong."""
    from tiny_models import make_tiny_chat_model

    return make_tiny_chat_model(tmp_path_factory.mktemp("draft") / "tiny-draft", seed=7)


@pytest.mark.parametrize("draft", ["self", "other"])
def test_a_draft_model_keeps_the_greedy_text(llm, tiny_dir, other_tiny, draft):
    path = tiny_dir if draft == "self" else other_tiny
    drafted = LLM(str(tiny_dir), kv_cache_memory_gib=0.02, max_num_seqs=8, max_model_len=512,
                  speculative_model=str(path), speculative_tokens=4)
    prompts = [LOOP, [40, 41, 42, 43] * 5, [300 + i for i in range(30)]]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = run(llm, prompts, params.replace(speculative_tokens=0))
    out = run(drafted, prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    stats = drafted.engine.stats
    assert stats.num_draft_tokens > 0
    if draft == "self":  # the model drafting for itself is right nearly always
        assert stats.num_accepted_tokens >= 0.8 * stats.num_draft_tokens
    # Requests that finished left no draft cache behind.
    assert not drafted.engine.speculator.shadows and drafted.engine.speculator.blocks.num_free_blocks == \
        drafted.engine.speculator.blocks.num_blocks
    drafted.engine.close()


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_dir, tiny_hf_dir):
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(tiny_dir), kv_cache_memory_gib=0.02, speculative_model=str(tiny_hf_dir("llama3")))


def test_a_failing_draft_source_costs_the_drafts_not_the_requests(llm, monkeypatch):
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain = run(llm, [LOOP], params.replace(speculative_tokens=0))[0].token_ids

    def broken(widths):
        raise RuntimeError("draft source failed")

    monkeypatch.setattr(llm.engine.speculator, "draft", broken)
    out = run(llm, [LOOP], params.replace(speculative_tokens=4))[0]
    assert out.token_ids == plain and out.finish_reason.value == "length"


def test_drafts_keep_the_greedy_text_of_a_lora_adapter_and_of_two_ranks(tiny_dir, tmp_path):
    from lora_adapters import ALL_TARGETS, make_peft_adapter

    adapter = tmp_path / "adapter"
    make_peft_adapter(tiny_dir, adapter, dict(r=4, lora_alpha=8, target_modules=ALL_TARGETS), seed=3)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [LOOP, [40, 41, 42, 43] * 5]
    with_lora = LLM(str(tiny_dir), kv_cache_memory_gib=0.02, max_num_seqs=4, lora=str(adapter))
    plain = run(with_lora, prompts, params.replace(speculative_tokens=0))
    drafted = run(with_lora, prompts, params.replace(speculative_tokens=4))
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert with_lora.engine.stats.num_accepted_tokens > 0
    # Two ranks, attention split by sequences (the tiny model has one KV head).
    ranks = LLM(str(tiny_dir), kv_cache_memory_gib=0.02, max_num_seqs=4, tensor_parallel_size=2,
                tensor_parallel_attention="sequences")
    try:
        plain = run(ranks, prompts, params.replace(speculative_tokens=0))
        drafted = run(ranks, prompts, params.replace(speculative_tokens=4))
        assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
        assert ranks.engine.stats.num_accepted_tokens > 0
    finally:
        ranks.engine.close()


def test_beside_other_sequences_only_requests_whose_drafts_pass_speculate():
    proposer = NgramProposer(default_tokens=4)
    poor = Request("poor", list(LOOP), SamplingParams(max_tokens=100))
    good = Request("good", list(LOOP), SamplingParams(max_tokens=100))
    proposer.propose([poor, good], 1000)  # learn: both propose
    for _ in range(4):
        proposer.record(poor, 4, 2)  # half kept
        proposer.record(good, 4, 4)
    assert set(proposer.propose([poor, good], 1000)) == {good}
    assert set(proposer.propose([poor], 1000)) == {poor}  # alone, any share pays
