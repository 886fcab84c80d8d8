"""The CPU attention's rows (model/attention/cpu_backend.py): a token's logits do not depend on how its
sequence was chunked or what else ran in its step, bit for bit, and a step that mixes rows with gathered
long chunks computes what the plain-torch reference computes."""

from __future__ import annotations

import pytest
import torch

import model.attention.cpu_backend as cpu_backend
from kernels import cpu_decode_attention
from model.loader import load
from model.step import SeqChunk, build_step, run_step

pytestmark = pytest.mark.skipif(not cpu_decode_attention.load(), reason="the C++ CPU kernels do not build here")


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    # W8A8: its C++ linear gives a row the same bits in any batch, as the served W4A8 does; float32 matmuls
    # take another code path for one row than for several, so their last bits depend on the chunk's length.
    return load(str(tiny_dir), dtype="float32", device="cpu", block_size=16, quantization="w8a8").module


def logits(module, chunks, num_blocks=64):
    caches = module.allocate_kv_caches(num_blocks)
    outs = []
    for step in chunks:  # each item: the chunks of one step
        outs.append(run_step(module, build_step(step, module.block_size, "cpu"), caches))
    return outs


def test_a_prompt_chunked_any_way_gives_the_same_logits(tiny):
    prompt = [(7 * i + 3) % 300 for i in range(40)]
    table = [0, 1, 2]
    whole = logits(tiny, [[SeqChunk(prompt, 0, table)]])[0]
    # After a prefix-cache hit of two blocks, the last 8 tokens come alone; or the prompt in three chunks.
    cached = logits(tiny, [[SeqChunk(prompt[:32], 0, table, 0)], [SeqChunk(prompt[32:], 32, table)]])[1]
    pieces = logits(tiny, [[SeqChunk(prompt[:5], 0, table, 0)], [SeqChunk(prompt[5:39], 5, table, 0)],
                           [SeqChunk(prompt[39:], 39, table)]])[2]
    assert torch.equal(whole, cached) and torch.equal(whole, pieces)


def test_a_tokens_logits_do_not_depend_on_its_step(tiny):
    prompt = [(5 * i + 1) % 300 for i in range(20)]
    other = [(3 * i + 2) % 300 for i in range(30)]
    alone = logits(tiny, [[SeqChunk(prompt, 0, [0, 1], 4)]])[0]  # the last 4 rows, as a verify step has
    beside = logits(tiny, [[SeqChunk(other, 0, [4, 5]), SeqChunk(prompt, 0, [0, 1], 4), SeqChunk([9], 0, [8])]])[0]
    assert torch.equal(alone, beside[1:5])


def test_rows_beside_gathered_chunks_compute_the_reference(tiny, monkeypatch):
    monkeypatch.setattr(cpu_backend, "SHORT_QUERY", 4)  # the 30-token chunk is gathered, the rest are rows
    torch.manual_seed(0)
    q = torch.randn(36, 4, 16)
    k, v = torch.randn(36, 2, 16), torch.randn(36, 2, 16)
    from model.attention import AttentionMetadata, TorchPagedAttention

    meta = AttentionMetadata.build([3, 30, 1, 2], [3, 40, 17, 2], [[0], [1, 2, 3], [4, 5], [6]], 16)
    cache = torch.randn(2, 8, 16, 2, 16)
    ours_backend = cpu_backend.CpuPagedAttention(16)
    plan = ours_backend.plan(meta)
    assert plan.gather is not None and len(plan.rows) == 6
    ours = ours_backend.forward(q, k, v, cache.clone(), plan, 0.25)
    reference_backend = TorchPagedAttention(16)
    reference = reference_backend.forward(q, k, v, cache.clone(), reference_backend.plan(meta), 0.25)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
