"""--kv-cache-dtype: a 16-bit KV cache under float32 activations (the CPU's quantized models). It holds twice
the tokens in the same memory, runs the C++ decoder step, and keeps what serving promises: a request's greedy
tokens the same with drafts, after a prefix-cache hit and in any batch."""

from __future__ import annotations

import pytest
import torch

import model
from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def w4a8():
    """The embedded default model as `ladder serve` runs it on a CPU (W4A8 over its GGUF's blocks)."""
    return model.load(quantization="w4a8")


def test_names_and_refusals():
    assert EngineConfig(kv_cache_dtype="bf16").kv_cache_dtype == "bf16"  # a precision's name is taken too
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int4'"):
        EngineConfig(kv_cache_dtype="int4")


@pytest.mark.parametrize("name,dtype", [("bfloat16", torch.bfloat16), ("fp16", torch.float16)])
def test_a_16bit_cache_holds_twice_the_tokens_and_keeps_greedy_text(w4a8, name, dtype):
    settings = {"kv_cache_memory_gib": 0.02, "max_model_len": 256, "max_num_seqs": 8}
    whole = LLM(loaded=w4a8, **settings)
    half = LLM(loaded=w4a8, kv_cache_dtype=name, **settings)
    assert whole.engine.runner.kv_caches[0].dtype == torch.float32
    assert half.engine.runner.kv_caches[0].dtype == dtype
    assert half.engine.blocks.num_blocks in (2 * whole.engine.blocks.num_blocks,
                                             2 * whole.engine.blocks.num_blocks + 1)
    prompts = ["Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
               "def add(a, b):\n    return a + b\n\ndef add(a, b):", "1, 2, 3, 4, 5,"]

    def greedy(llm: LLM, drafts: int, batch: list[str]) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, speculative_tokens=drafts)
        return [r.outputs[0].token_ids for r in llm.generate(batch, params)]

    batched = greedy(half, 0, prompts)
    assert w4a8.module.cpu_step is not None, w4a8.module.cpu_step_reason  # the C++ step ran over the 16-bit cache
    hits = half.engine.blocks.prefix_hits
    assert greedy(half, 6, prompts) == batched  # drafts verified over the 16-bit cache, prompts found cached
    assert half.engine.blocks.prefix_hits > hits and half.engine.stats.num_accepted_tokens > 0
    assert [greedy(half, 0, [p])[0] for p in prompts] == batched  # alone as in a batch
    assert w4a8.module.kv_cache_dtype == dtype  # until an engine asks for another
    LLM(loaded=w4a8, **settings)
    assert w4a8.module.kv_cache_dtype == torch.float32
