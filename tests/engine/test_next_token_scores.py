"""An embedding request that asks for the next token's logits of chosen tokens (SamplingParams.score_token_ids,
what /v1/rerank reads as "no" and "yes"): on the embedded model as `ladder serve` runs it on a CPU (W4A8,
its quantized output layer), the logits' differences equal those of the log-probabilities a generating
request of the same prompt reports for the same tokens, beside other requests and after a prefix-cache
hit; and such requests are refused where they cannot mean anything."""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams

PROMPT = "Is Paris the capital of France? Answer yes or no:"


@pytest.fixture(scope="module")
def llm():
    return LLM(quantization="w4a8", kv_cache_memory_gib=0.05, max_model_len=512, max_num_seqs=8)


def run(llm: LLM, requests: dict[str, tuple[list[int], SamplingParams, str | None]]) -> dict:
    for request_id, (ids, params, pooling) in requests.items():
        llm.engine.add_request(request_id, ids, params, pooling=pooling)
    out = {}
    while llm.engine.has_unfinished():
        for delta in llm.engine.step():
            assert delta.error is None, delta.error
            out.setdefault(delta.request_id, []).append(delta)
    return out


def test_scores_are_the_logits_a_generating_request_sees(llm):
    ids = llm.tokenizer.encode(PROMPT)
    sampled = run(llm, {"gen": (ids, SamplingParams(max_tokens=1, temperature=0, logprobs=20), None)})
    top = sampled["gen"][0].logprobs[0].top  # [(token, logprob)] best first
    chosen = tuple(token for token, _ in top[:3])
    logprob = dict(top)
    other = llm.tokenizer.encode("A different prompt, generating beside the scored ones.")
    deltas = run(llm, {
        "score": (ids, SamplingParams(max_tokens=1, score_token_ids=chosen), "last"),
        "again": (ids, SamplingParams(max_tokens=1, score_token_ids=chosen[::-1]), "last"),  # cached prefix
        "beside": (other, SamplingParams(max_tokens=8, temperature=0), None),
    })
    logits = deltas["score"][-1].embedding
    assert logits.shape == (3,) and deltas["score"][-1].finished
    for k in (1, 2):
        assert float(logits[0] - logits[k]) == pytest.approx(logprob[chosen[0]] - logprob[chosen[k]], abs=1e-4)
    assert deltas["again"][-1].embedding.tolist() == logits.flip(0).tolist()
    assert deltas["beside"][-1].num_output_tokens == 8


def test_scores_need_the_last_tokens_pooling_and_real_tokens(llm):
    ids = llm.tokenizer.encode(PROMPT)
    with pytest.raises(ValueError, match="last token's pooling"):
        llm.engine.add_request("mean", ids, SamplingParams(max_tokens=1, score_token_ids=(1,)), pooling="mean")
    with pytest.raises(ValueError, match="score_token_ids must be in"):
        llm.engine.add_request("big", ids, SamplingParams(max_tokens=1, score_token_ids=(10**6,)), pooling="last")


def test_llm_next_token_logits_batches_prompts_in_order(llm):
    prompts = [PROMPT, "The sky is blue. True or false? Answer:", PROMPT]
    yes, no = llm.tokenizer.encode(" yes", add_special_tokens=False), llm.tokenizer.encode(" no",
                                                                                         add_special_tokens=False)
    logits = llm.next_token_logits(prompts, [yes[0], no[0]])
    assert logits.shape == (3, 2) and torch.equal(logits[0], logits[2])
    alone = llm.next_token_logits(prompts[1], [yes[0], no[0]])
    assert torch.allclose(alone[0], logits[1], atol=1e-5)
    with pytest.raises(ValueError, match="token_ids is empty"):
        llm.next_token_logits(PROMPT, [])
