"""Expert parallelism over 2 tensor-parallel ranks on this CPU (gloo): each rank holds half of every sparse
layer's experts, and the all-reduce after the block sums the ranks' parts (parallel/shard.py).

One 2-rank engine per tiny MoE family (attention split by heads; Qwen3-MoE's dense middle layer split by
columns), started once: its greedy tokens, alone and batched, are one process's, and the logits of a flat
batch of several sequences are one process's up to the order of float additions. One more engine runs
the tiny Qwen3-MoE in int8 with attention split by sequences. A size that does not divide the experts is
refused in one line before any process starts.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import model
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import bytes_per_block
from model.moe import Int8SparseMoeBlock, SparseMoeBlock
from model.sequences import Sequences
from parallel.layout import TensorParallelLayout
from parallel.tensor_parallel_model import TensorParallelModel, start
from greedy_checks import count_near_ties
from tiny_models import MOE_FAMILIES

NUM_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=2)


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 320, (n,), generator=generator).tolist() for n in (9, 23, 31, 14)]


def run(engine: LLMEngine, batch: list[list[int]]) -> list[tuple[list, list]]:
    """Every prompt together: per prompt (tokens, logprobs)."""
    for i, prompt in enumerate(batch):
        engine.add_request(str(i), prompt, GREEDY)
    out: dict[str, list] = {str(i): [] for i in range(len(batch))}
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id].append(delta)
    return [([t for d in deltas for t in d.token_ids], [lp for d in deltas for lp in d.logprobs])
            for deltas in out.values()]


def run_alone(engine: LLMEngine, batch: list[list[int]]) -> list[tuple[list, list]]:
    return [run(engine, [prompt])[0] for prompt in batch]


def new_engine(loaded, tensor_parallel_size: int, attention: str = "heads") -> LLMEngine:
    per_block = bytes_per_block(loaded.config, 16, torch.float32)
    return LLMEngine(EngineConfig(kv_cache_memory_gib=16 * per_block / 2**30, max_model_len=64, max_num_seqs=4,
                                  tensor_parallel_size=tensor_parallel_size, tensor_parallel_attention=attention),
                     loaded=loaded)


def assert_close_logprobs(reference: list[tuple[list, list]], got: list[tuple[list, list]]) -> None:
    for (ref_tokens, ref_logprobs), (tokens, logprobs) in zip(reference, got, strict=True):
        assert tokens == ref_tokens
        for a, b in zip(ref_logprobs, logprobs, strict=True):
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert all(abs(x - y) <= 1e-4 * max(1.0, abs(x)) for (_, x), (_, y) in zip(a.top, b.top))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe(request, tiny_hf_dir):
    """(loaded one-process model, its tokens per prompt alone, a 2-rank engine)."""
    loaded = model.load(tiny_hf_dir(request.param))
    reference = run_alone(new_engine(loaded, 1), prompts())
    engine = new_engine(loaded, 2)
    yield loaded, reference, engine
    engine.close()
    assert all(worker.exitcode is not None for worker in engine.runner.module.workers)


def test_each_rank_holds_half_of_the_experts(moe):
    loaded, _, engine = moe
    module = engine.runner.module
    assert isinstance(module, TensorParallelModel) and module.layout.experts == (range(4), range(4, 8))
    config = loaded.config
    for i, layer in enumerate(module.shard.layers):
        if config.is_sparse_layer(i):
            assert isinstance(layer.mlp, SparseMoeBlock) and layer.mlp.expert_offset == 0
            assert layer.mlp.w13.shape == (4, 64, 64) and layer.mlp.w2.shape == (4, 64, 32)
            assert layer.mlp.gate.weight.shape == (8, 64)  # the router whole: every rank routes every token
            assert torch.equal(layer.mlp.w13, loaded.module.layers[i].mlp.w13[:4])
        else:  # Qwen3-MoE's dense layer: split by columns, as a dense model's
            assert layer.mlp.down_proj.in_features == config.intermediate_size // 2
    assert loaded.module.layers[0].mlp.w13.shape[0] == 8  # the model passed in is left whole


def test_two_ranks_give_one_process_tokens(moe):
    _, reference, engine = moe
    assert_close_logprobs(reference, run_alone(engine, prompts()))


def test_a_flat_batch_gives_each_prompt_its_tokens(moe):
    _, reference, engine = moe
    batched = run(engine, prompts())
    assert count_near_ties(reference, [tokens for tokens, _ in batched], NUM_TOKENS) == 0
    seconds = engine.stats.snapshot()["communication"]
    assert seconds["all_reduce"] > 0 and seconds["gather"] > 0


def test_logits_of_a_flat_batch_match_one_process(moe):
    """Runs last for its engine: a private cache replaces the engine's on every rank."""
    loaded, _, engine = moe
    batch = prompts()
    split = Sequences(engine.runner.module, len(batch), 48).step(batch, all_rows=True)
    whole = Sequences(loaded.module, len(batch), 48).step(batch, all_rows=True)
    assert split.shape == whole.shape == (sum(map(len, batch)), 320)
    assert relative_error(split, whole) < 1e-4
    assert torch.equal(split.argmax(-1), whole.argmax(-1))


def test_int8_experts_with_attention_split_by_sequences(tiny_hf_dir):
    loaded = model.load(tiny_hf_dir("qwen3_moe"), quantization="int8")
    reference = run_alone(new_engine(loaded, 1), prompts())
    engine = new_engine(loaded, 2, "sequences")
    try:
        block = engine.runner.module.shard.layers[0].mlp
        assert isinstance(block, Int8SparseMoeBlock) and block.w13.shape[0] == 4 and block.w13_packed is not None
        assert_close_logprobs(reference, run_alone(engine, prompts()))
        batched = run(engine, prompts())
        assert count_near_ties(reference, [tokens for tokens, _ in batched], NUM_TOKENS) == 0
    finally:
        engine.close()
    assert all(worker.exitcode is not None for worker in engine.runner.module.workers)


def test_a_size_that_does_not_divide_the_experts_is_refused_in_one_line(tiny_hf_dir):
    loaded = model.load(tiny_hf_dir("mixtral"))
    odd = loaded.config.replace(num_experts=7)
    message = "--tensor-parallel-size 2 does not divide the model's 7 experts: each rank must hold the same"
    with pytest.raises(ValueError, match=message) as raised:
        TensorParallelLayout.for_model(odd, 2, "sequences")
    assert "\n" not in str(raised.value)
    with pytest.raises(ValueError, match=message):  # refused before any worker starts
        start(dataclasses.replace(loaded, config=odd), 2)
    assert TensorParallelLayout.for_model(odd, 1).experts == (range(7),)


def test_gemma3_splits_by_heads_with_its_windows(tiny_hf_dir):
    """Gemma 3's two kinds of layers (a 16-token window, shorter than the prompts, and full attention) on 2
    ranks split by heads: each rank plans both windows, and the tokens are one process's. A split by
    sequences, which plans one window, is refused in one line before any process starts."""
    loaded = model.load(tiny_hf_dir("gemma3"))
    reference = run_alone(new_engine(loaded, 1), prompts())
    engine = new_engine(loaded, 2)
    try:
        assert_close_logprobs(reference, run(engine, prompts()))
    finally:
        engine.close()
    with pytest.raises(ValueError, match="plans one window"):
        start(loaded, 2, attention="sequences")
