"""Sliding-window layers that keep only their window (engine/window_blocks.py): the bookkeeping alone, then
the engine on a tiny Gemma 3 and a tiny Gemma 4 (a 16-token window on half their layers, 4-token blocks)
against the model run without the engine, whose layers all share one block table."""

from __future__ import annotations

import pytest
import torch

import model
from engine.block_manager import KVBlockManager
from engine.llm import LLM
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.window_blocks import DROPPED, WindowedBlockManager
from model.generator import Generator

BLOCK, WINDOW = 4, 16
MOST_HELD = -(-(WINDOW - 1) // BLOCK) + 1  # the blocks one query at a time can see: 5


def request(tokens: list[int], name: str = "r") -> Request:
    return Request(name, tokens, SamplingParams(max_tokens=64))


def advance(blocks: WindowedBlockManager, req: Request, num_tokens: int) -> None:
    """What the scheduler and the engine do for a step of `num_tokens` new tokens."""
    assert blocks.allocate(req, num_tokens)
    req.num_computed_tokens += num_tokens
    blocks.register_computed_blocks(req)


def held(req: Request) -> list[int]:
    return [b for b in req.window_block_ids if b != DROPPED]


def test_a_growing_sequence_holds_its_window_only():
    blocks = WindowedBlockManager(64, 12, BLOCK, WINDOW)
    req = request(list(range(100)))
    advance(blocks, req, 10)  # a prompt chunk: every block its queries see
    assert len(held(req)) == 3
    for _ in range(90):  # decodes
        advance(blocks, req, 1)
        position = req.num_computed_tokens - 1
        first = max(0, position - WINDOW + 1) // BLOCK
        assert req.window_block_ids[:first] == [DROPPED] * first and DROPPED not in req.window_block_ids[first:]
        assert len(held(req)) <= MOST_HELD + 1
    assert len(req.block_ids) == 25  # the full-attention layers keep every block
    assert blocks.num_free_window_blocks == 12 - len(held(req))
    blocks.release(req)
    assert blocks.num_free_window_blocks == 12 and blocks.num_free_blocks == 64


def test_a_full_window_pool_refuses_and_changes_nothing():
    blocks = WindowedBlockManager(64, 4, BLOCK, WINDOW)
    req = request(list(range(40)))
    assert not blocks.allocate(req, 20)  # 5 windowed blocks at once: more than the pool
    assert req.block_ids == [] and req.window_block_ids == [] and blocks.num_free_blocks == 64


def test_a_cached_prefix_needs_its_window_blocks():
    blocks = WindowedBlockManager(64, 12, BLOCK, WINDOW)
    first = request(list(range(40)), "a")
    advance(blocks, first, 40)
    cached_window = list(first.window_block_ids)
    blocks.release(first)
    second = request(list(range(40)) + [7, 7, 7], "b")
    prefix = blocks.cached_prefix(second)
    # The prefix's first query (position 40) sees positions 25..39: blocks 6..9 of the windowed layers.
    assert prefix.num_tokens == 40 and list(prefix.window_block_ids) == cached_window[6:10]
    assert blocks.allocate(second, 3, prefix)
    assert second.window_block_ids[:6] == [DROPPED] * 6 and second.window_block_ids[6:10] == cached_window[6:10]
    assert len(second.window_block_ids) == 11
    blocks.release(second)
    # Another sequence takes every windowed block: the cached ones are evicted, and with them the prefix,
    # although the full-attention layers' blocks are still cached.
    hog = request(list(range(2000, 2048)), "d")
    advance(blocks, hog, 48)
    assert blocks.num_free_window_blocks == 0
    assert blocks.cached_prefix(second).num_tokens == 0
    assert KVBlockManager.cached_prefix(blocks, second).num_tokens == 40


@pytest.fixture(scope="module", params=["gemma3", "gemma4_e"])
def gemma(request, tiny_hf_dir):
    """Gemma 3, and Gemma 4's small shape: its last two layers read the first two's caches (one in the window
    pool, one in the full-attention pool), their heads of two sizes."""
    return model.load(tiny_hf_dir(request.param), block_size=BLOCK)


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 320, (n,), generator=generator).tolist() for n in (5, 23, 41, 60)]


def reference(gemma, batch: list[list[int]], num_tokens: int) -> list[list[int]]:
    return [[s.token_id for s in Generator(gemma.module, 128).generate(p, num_tokens)] for p in batch]


def test_engine_tokens_equal_the_shared_table_model(gemma):
    llm = LLM(loaded=gemma, kv_cache_memory_gib=0.01, max_model_len=256, block_size=BLOCK)
    blocks = llm.engine.blocks
    assert isinstance(blocks, WindowedBlockManager) and blocks.num_window_blocks < blocks.num_blocks
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = reference(gemma, prompts(), 40)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts(), params)] == expected
    # Again: the prompts' blocks come from the prefix cache, window blocks included.
    hits = blocks.prefix_hits
    assert [o.outputs[0].token_ids for o in llm.generate(prompts(), params)] == expected
    assert blocks.prefix_hits > hits
    assert blocks.num_free_window_blocks == blocks.num_window_blocks
    stats = llm.engine.stats.snapshot()  # what /metrics reports (ladder_kv_window_blocks, ..._free_blocks)
    assert stats["num_window_blocks"] == stats["num_free_window_blocks"] == blocks.num_window_blocks


def test_engine_under_a_small_cache_preempts_and_keeps_the_tokens(gemma):
    """Four sequences of up to 100 tokens in 48 full-attention blocks of 4 tokens: some are preempted and
    recomputed; their windows never hold more than a few blocks each."""
    from engine.config import bytes_per_block

    per_block = bytes_per_block(gemma.config, BLOCK, torch.float32)
    llm = LLM(loaded=gemma, kv_cache_memory_gib=48 * per_block / 2**30, max_model_len=128, block_size=BLOCK,
              max_num_seqs=4)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(prompts()):
        engine.add_request(str(i), prompt, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(4)}
    computed: dict[tuple[str, int], int] = {}  # (request, its preemptions so far) -> tokens computed
    most_held = 0  # by a sequence after a decode step (a prompt chunk holds a block per 4 of its tokens)
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id].extend(delta.token_ids)
        for r in engine.scheduler.running:
            key = (r.request_id, r.num_preemptions)
            if r.num_computed_tokens == computed.get(key, -2) + 1:
                most_held = max(most_held, len(held(r)))
            computed[key] = r.num_computed_tokens
    assert engine.scheduler.num_preemptions > 0
    assert list(out.values()) == reference(gemma, prompts(), 40)
    assert 0 < most_held <= MOST_HELD + 1  # what the last query saw, and the block of the next token


def test_shared_prefixes_in_a_small_cache_keep_every_prompts_tokens(gemma):
    """Twelve prompts that share prefixes of several lengths (some inside the window, some past it), four
    running at a time in 40 full-attention blocks and a window pool to match: prefix hits, evictions and
    preemptions all happen, and every prompt's greedy tokens are the model's without the engine."""
    from engine.config import bytes_per_block

    generator = torch.Generator().manual_seed(3)
    stems = [torch.randint(3, 320, (n,), generator=generator).tolist() for n in (8, 30, 52)]
    batch = [stems[i % 3] + torch.randint(3, 320, (1 + 5 * i % 11,), generator=generator).tolist()
             for i in range(12)]
    per_block = bytes_per_block(gemma.config, BLOCK, torch.float32)
    llm = LLM(loaded=gemma, kv_cache_memory_gib=40 * per_block / 2**30, max_model_len=96, block_size=BLOCK,
              max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(batch, params)] == reference(gemma, batch, 24)
    blocks = llm.engine.blocks
    assert blocks.prefix_hits > 0 and llm.engine.scheduler.num_preemptions > 0
    assert blocks.num_free_window_blocks == blocks.num_window_blocks and blocks.num_free_blocks == blocks.num_blocks


def test_a_model_whose_every_layer_is_windowed_keeps_only_windows(tmp_path):
    """A Mistral with a 16-token window on every layer: every cache is the windowed pool (the full-attention
    blocks are bookkeeping for the prefix cache only), and the tokens are the model's without the engine."""
    import transformers

    config = transformers.MistralConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                        initializer_range=0.2, sliding_window=WINDOW)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path, safe_serialization=True)
    mistral = model.load(tmp_path, block_size=BLOCK)
    llm = LLM(loaded=mistral, kv_cache_memory_gib=0.001, max_model_len=256, block_size=BLOCK, max_num_seqs=4)
    blocks = llm.engine.blocks
    assert isinstance(blocks, WindowedBlockManager)
    assert [cache.shape[1] for cache in llm.engine.runner.kv_caches] == [blocks.num_window_blocks] * 2
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = reference(mistral, prompts(), 40)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts(), params)] == expected
    assert [o.outputs[0].token_ids for o in llm.generate(prompts(), params)] == expected
    assert blocks.prefix_hits > 0
