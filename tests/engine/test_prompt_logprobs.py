"""Prompt log-probabilities (SamplingParams.prompt_logprobs): each prompt token's log-probability after the
tokens before it, as transformers computes it on the same weights; the same whatever the prompt's chunks,
its batch, the prefix cache or its n samples; a failure ends the request, not the engine."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from engine import FinishReason, SamplingParams
from engine import llm_engine as engine_module
from engine.llm import LLM
from tiny_models import write_gguf

PROMPTS = [[5, 17, 200, 31, 9, 44, 101, 7, 250, 3, 66, 12, 90, 140, 2, 18, 77],
           [8, 8, 8, 120, 33, 61]]


@pytest.fixture(scope="module")
def hf_and_llm(tiny_hf_dir):
    directory = tiny_hf_dir("llama3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    llm = LLM(str(directory), quantization="none", kv_cache_memory_gib=0.02, max_model_len=128)
    return hf, llm


def reference(hf, ids: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """transformers' log-probabilities of ids[1:] [P - 1], the k best token ids at each position and each
    token's rank (1 + the tokens more likely than it)."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, torch.tensor(ids[1:])[:, None])
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    return chosen[:, 0], logprobs.topk(k, dim=-1).indices, ranks


def scores(output) -> list[tuple[int, float, tuple]]:
    return [(e.token_id, e.logprob, e.top) for e in output.prompt_logprobs]


def test_prompt_logprobs_equal_transformers(hf_and_llm):
    hf, llm = hf_and_llm
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
    for ids, output in zip(PROMPTS, outputs, strict=True):
        want, want_top, want_ranks = reference(hf, ids, 3)
        got = output.prompt_logprobs
        assert [e.token_id for e in got] == ids[1:] and [e.rank for e in got] == want_ranks
        assert torch.allclose(torch.tensor([e.logprob for e in got]), want, atol=1e-4)
        assert [[t for t, _ in e.top] for e in got] == want_top.tolist()
        assert all(e.top[0][1] >= e.logprob for e in got)  # the best is at least as likely as the token
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=2))
    assert plain[0].prompt_logprobs is None
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def w4a8_llm(hf_and_llm, tmp_path_factory):
    """The same model from a Q4_1 GGUF in W4A8, as a CPU serves it: its rows do not depend on their batch."""
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    write_gguf(hf_and_llm[0], path, "Q4_1")
    return LLM(str(path), quantization="w4a8", kv_cache_memory_gib=0.02, max_model_len=128)


def test_the_same_in_chunks_beside_other_requests_and_after_a_cached_prompt(w4a8_llm):
    """The prompt in 5-token chunks, beside requests that do not score theirs, after the same prompt was
    cached: the same values bit for bit, and each of n samples carries them."""
    llm = w4a8_llm
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    whole = scores(llm.generate([PROMPTS[0]], params)[0])
    scheduler = llm.engine.scheduler
    config = scheduler.config
    scheduler.config = dataclasses.replace(config, max_scored_tokens=5)
    try:
        batch = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[0]],
                             [SamplingParams(temperature=0, max_tokens=3), params, params.replace(n=2)])
    finally:
        scheduler.config = config
    assert batch[0].prompt_logprobs is None
    assert scores(batch[1]) == whole and scores(batch[2]) == whole
    assert batch[1].outputs[0].token_ids == batch[2].outputs[0].token_ids == batch[2].outputs[1].token_ids


def test_a_scored_prompt_is_computed_not_read_from_the_prefix_cache(hf_and_llm):
    _, llm = hf_and_llm
    engine = llm.engine
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]  # over a block, so a second run could hit
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))
    engine.add_request("scored", ids, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert deltas[0].num_cached_tokens == 0 and len(deltas[0].prompt_logprobs) == len(ids) - 1
    assert all(e.top == () for e in deltas[0].prompt_logprobs)  # prompt_logprobs=0: the token's alone


def test_out_of_range_is_refused():
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=-1)


def test_a_failed_scoring_ends_its_request_alone(hf_and_llm, monkeypatch):
    _, llm = hf_and_llm
    engine = llm.engine

    def broken(*args):
        raise RuntimeError("no logprobs today")

    monkeypatch.setattr(engine_module, "compute_logprobs", broken)
    engine.add_request("bad", PROMPTS[1], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1))
    engine.add_request("good", PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    bad = [d for d in deltas if d.request_id == "bad"]
    good = [d for d in deltas if d.request_id == "good"]
    assert [d.finish_reason for d in bad] == [FinishReason.ERROR]
    assert bad[0].error == engine_module.PROMPT_SCORING_FAILED and not bad[0].token_ids
    assert sum(len(d.token_ids) for d in good) == 4 and good[-1].finish_reason is FinishReason.LENGTH


def test_a_prompt_scored_beside_a_speculating_request(w4a8_llm, monkeypatch):
    """A prompt scored in a step where another request verifies prompt-lookup drafts: each gets what it gets
    alone (the scored rows come out before the sampled and draft rows)."""
    llm = w4a8_llm
    engine = llm.engine
    steps = []  # (scores a prompt, verifies drafts) of each step
    prepare = engine.runner.prepare

    def spying(batch):
        inputs = prepare(batch)
        steps.append((bool(inputs.scored), inputs.speculates))
        return inputs

    monkeypatch.setattr(engine.runner, "prepare", spying)
    repeating = [5, 6] * 10  # a tiny random model's greedy answer falls into a loop, where prompt lookup drafts
    speculating = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, speculative_tokens=4)
    scored = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    alone_spec = llm.generate([repeating], speculating)[0].outputs[0].token_ids
    alone_scored = scores(llm.generate([PROMPTS[0]], scored)[0])
    engine.add_request("spec", repeating, speculating)
    deltas = []
    for _ in range(48):  # until a step verifies drafts
        deltas += engine.step()
        if steps[-1][1]:
            break
    assert steps[-1][1], "no drafts to verify"
    engine.add_request("scored", PROMPTS[0], scored)
    while engine.has_unfinished():
        deltas += engine.step()
    assert (True, True) in steps
    assert [t for d in deltas if d.request_id == "spec" for t in d.token_ids] == alone_spec
    first = next(d for d in deltas if d.request_id == "scored" and d.prompt_logprobs is not None)
    assert [(e.token_id, e.logprob, e.top) for e in first.prompt_logprobs] == alone_scored
