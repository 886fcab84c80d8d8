"""The engine on the real default model: batch invariance, preemption, prefix caching, sampling, stops."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from engine.config import bytes_per_block
from engine.async_engine import ENGINE_DIED, MAX_CONSECUTIVE_STEP_FAILURES, STEP_FAILED, AsyncLLMEngine, EngineDeadError
from engine.llm import LLM
from greedy_checks import count_near_ties

NUM_TOKENS = 16
TEXTS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves falling in a quiet park.",
    "Explain briefly how a hash table works, and when it is slow.",
    "Hi",
    "List three uses of copper.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Translate to French: the cat sleeps on the warm windowsill all afternoon.",
    "Why is the sky blue? Answer in one sentence.",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "def fibonacci(n):\n    ",
    "Summarize the plot of a detective story in which the butler did not do it, but the gardener did.",
    "2 + 2 =",
    "Name a famous painting.",
    "Describe the water cycle to a ten year old child, using simple words and a friendly tone, please.",
    "Give me a recipe idea with tomatoes.",
    "What are the three states of matter?",
]


@pytest.fixture(scope="module")
def loaded(default_model):
    return default_model


def engine(loaded, **overrides) -> LLMEngine:
    config = {"kv_cache_memory_gib": 0.05, "max_model_len": 512, "max_num_seqs": 16, **overrides}
    return LLMEngine(EngineConfig(**config), loaded=loaded)


@pytest.fixture(scope="module")
def prompts(loaded):
    tok = loaded.tokenizer
    chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]), add_special_tokens=False)
             for t in TEXTS[:8]]
    raw = [tok.encode(t) for t in TEXTS[8:]]
    return chats + raw


def run_all(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list]:
    outputs: dict[str, list] = {}
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
        outputs[str(i)] = []
    while eng.has_unfinished():
        for d in eng.step():
            outputs.setdefault(d.request_id, []).append(d)
    return outputs


def tokens(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def solo(loaded, prompts):
    """Each prompt alone: the reference tokens and their top-2 logprobs."""
    results = []
    for p in prompts:
        out = run_all(engine(loaded, max_num_seqs=1), [p], GREEDY)["0"]
        results.append((tokens(out), [lp for d in out for lp in d.logprobs]))
    return results


def near_ties(solo, outputs) -> int:
    """Check each request's tokens against its solo run; a divergence is allowed only at a near tie
    (top-2 logprob gap under 1e-3 where it first differs). Returns how many requests diverged so."""
    return count_near_ties(solo, [tokens(outputs[str(i)]) for i in range(len(solo))], NUM_TOKENS)


@pytest.fixture(scope="module")
def busy(loaded, prompts):
    """The 16 prompts batched together in one engine with room for all of them."""
    return run_all(engine(loaded), prompts, GREEDY)


@pytest.fixture(scope="module")
def preempted(loaded, prompts):
    """The 16 prompts through a cache of 12 blocks of 16 tokens: the longest request fits alone, the
    batch cannot, so requests are preempted and recomputed. (engine, outputs)"""
    per_block = bytes_per_block(loaded.config, 16, torch.float32)
    eng = engine(loaded, kv_cache_memory_gib=12 * per_block / 2**30, max_model_len=192)
    return eng, run_all(eng, prompts, GREEDY)


@pytest.fixture(scope="module")
def prefix_hit(loaded, prompts):
    """Prompt 0 run first to fill the prefix cache, then all 16 prompts. (engine, hits gained, outputs)"""
    eng = engine(loaded)
    run_all(eng, prompts[:1], GREEDY)
    hits_before = eng.stats.prefix_hits
    outputs = run_all(eng, prompts, GREEDY)
    return eng, eng.stats.prefix_hits - hits_before, outputs


@pytest.fixture(scope="module")
def chunked(loaded, prompts):
    """The 16 prompts with at most 24 tokens per step, so prompts are prefilled in chunks."""
    return run_all(engine(loaded, max_num_batched_tokens=24), prompts, GREEDY)


def test_batch_of_16_mixed_lengths_gives_each_prompt_its_solo_tokens(prompts, solo, busy):
    assert len({len(p) for p in prompts}) > 8
    near_ties(solo, busy)


def test_preempted_requests_recompute_their_solo_tokens(solo, preempted):
    eng, outputs = preempted
    assert eng.blocks.num_blocks == 12
    assert eng.stats.num_preemptions > 0
    near_ties(solo, outputs)
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_prefix_cache_hit_gives_the_solo_tokens(prompts, solo, prefix_hit):
    _, hits, outputs = prefix_hit
    assert hits >= 16 * (len(prompts[0]) // 16)
    assert outputs["0"][-1].num_cached_tokens > 0
    near_ties(solo, outputs)


def test_chunked_prefill_gives_the_solo_tokens(solo, chunked):
    near_ties(solo, chunked)


def test_near_ties_are_rare_across_every_invariance_run(solo, busy, preempted, prefix_hit, chunked):
    """Counted over all four runs whichever tests were selected: each run is a fixture of its own."""
    count = sum(near_ties(solo, outputs) for outputs in (busy, preempted[1], prefix_hit[2], chunked))
    print(f"near ties accepted across the invariance runs: {count}")
    assert count <= 3


def test_seeded_sampling_alone_and_in_a_busy_batch(loaded, prompts):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=42, max_tokens=12, ignore_eos=True)
    alone = tokens(run_all(engine(loaded), [prompts[1]], seeded)["0"])
    eng = engine(loaded)
    busy = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    for i, p in enumerate(prompts[2:8]):
        eng.add_request(f"noise{i}", p, busy)
    outputs = run_all(eng, [prompts[1]], seeded)
    assert tokens(outputs["0"]) == alone


def test_abort_frees_every_block(loaded, prompts):
    eng = engine(loaded)
    for i, p in enumerate(prompts[:6]):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.blocks.num_free_blocks < eng.blocks.num_blocks
    for i in range(6):
        eng.abort(str(i))
    deltas = eng.step()
    assert {d.finish_reason for d in deltas} == {FinishReason.ABORT}
    assert not eng.has_unfinished()
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_stop_strings_end_the_text_before_them_and_n_gives_distinct_samples(loaded):
    llm = LLM(loaded=loaded, kv_cache_memory_gib=0.05, max_model_len=512)
    free = llm.chat([{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
                    SamplingParams(temperature=0, max_tokens=40)).outputs[0]
    assert "4" in free.text
    stop_at = free.text[free.text.index("4"):][:2]  # e.g. "4,"
    out = llm.chat([{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
                   SamplingParams(temperature=0, max_tokens=40, stop=[stop_at])).outputs[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.text == free.text[: free.text.index(stop_at)]  # the stop string itself is not returned
    # ignore_eos: the first token is the end of text with probability 0.58 here, so three samples that
    # each end at once would be equal by chance.
    many = llm.generate(["Tell me a fun fact."],
                        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True))[0]
    assert len(many.outputs) == 3 and len({tuple(o.token_ids) for o in many.outputs}) > 1
    assert all(o.finish_reason is not None for o in many.outputs)


def test_request_that_never_fits_gets_an_error(loaded):
    eng = engine(loaded, max_model_len=64)
    eng.add_request("x", list(range(10, 60)), SamplingParams(max_tokens=30))
    deltas = eng.step()
    assert deltas[0].finish_reason is FinishReason.ERROR and "max_model_len (64)" in deltas[0].error
    assert not eng.has_unfinished()


def test_async_engine_streams_aborts_and_reports_death(loaded, prompts):
    async def scenario():
        eng = AsyncLLMEngine(engine(loaded))
        pieces = [d async for d in eng.generate(prompts[0], SamplingParams(temperature=0, max_tokens=8))]
        assert pieces[-1].finished and sum(len(p.token_ids) for p in pieces) == pieces[-1].num_output_tokens
        stream = eng.generate(prompts[1], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        await stream.__anext__()
        await stream.aclose()  # the client went away
        for _ in range(100):
            await asyncio.sleep(0.05)
            if eng.engine.blocks.num_free_blocks == eng.engine.blocks.num_blocks and not eng.engine.requests:
                break
        assert eng.engine.blocks.num_free_blocks == eng.engine.blocks.num_blocks

        def broken(_inputs):
            raise RuntimeError("injected fault")

        eng.engine.runner.forward = broken
        for _ in range(MAX_CONSECUTIVE_STEP_FAILURES - 1):  # a failed step fails its requests; the engine goes on
            deltas = [d async for d in eng.generate(prompts[2], SamplingParams(max_tokens=4))]
            assert deltas[-1].finish_reason is FinishReason.ERROR and deltas[-1].error == STEP_FAILED
            assert eng.is_alive and eng.engine.blocks.num_free_blocks == eng.engine.blocks.num_blocks
        deltas = [d async for d in eng.generate(prompts[2], SamplingParams(max_tokens=4))]
        assert deltas[-1].finish_reason is FinishReason.ERROR and deltas[-1].error == ENGINE_DIED
        assert not eng.is_alive and "injected fault" in eng.dead_reason
        with pytest.raises(EngineDeadError):
            async for _ in eng.generate(prompts[2], SamplingParams(max_tokens=4)):
                pass
        eng.shutdown()

    asyncio.run(scenario())


def test_an_engine_that_loads_its_model_keeps_int8_weights_in_their_kernels_layout_only(tiny_dir):
    """W8A8 linears held each weight twice (plain and packed). An engine that loaded its model drops the plain
    copies and serves the same tokens as an engine given the model, which it leaves whole for its caller."""
    import model as model_pkg

    owned = LLMEngine(EngineConfig(model=str(tiny_dir), quantization="w8a8", kv_cache_memory_gib=0.01,
                                   max_model_len=128))
    given = model_pkg.load(str(tiny_dir), quantization="w8a8")
    shared = LLMEngine(EngineConfig(model=str(tiny_dir), kv_cache_memory_gib=0.01, max_model_len=128), loaded=given)
    head = owned.model.module.lm_head
    assert head.packed is not None and head.weight.numel() == 0
    assert given.module.lm_head.weight.shape == (given.config.vocab_size, given.config.hidden_size)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    owned_tokens, shared_tokens = (tokens(run_all(e, [[1, 5, 9, 13, 17]], params)["0"]) for e in (owned, shared))
    assert owned_tokens == shared_tokens and len(owned_tokens) == 12
