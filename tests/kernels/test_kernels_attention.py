"""Paged attention kernels (decode with split-K, prefill chunks) against the reference, and the reference
against the model's own attention.

Cache slots that hold no position of their sequence are NaN for the kernels (zero for the reference),
so a kernel that reads past a sequence's end, or outside its blocks, fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from kernel_checks import DEVICE, DTYPES, assert_matches, poisoned_allocations, randn

from kernels.runtime import HAS_TRITON, TRITON_IMPORT_ERROR

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason=f"triton is not importable ({TRITON_IMPORT_ERROR})")

# (query heads, KV heads, head_dim): the default model's, and GQA ratios 1, 8 and 2.
HEADS = [(9, 3, 64), (8, 8, 32), (8, 1, 64), (4, 2, 16)]
BLOCK_SIZE = 16


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, H, D]
    cache: torch.Tensor  # for the kernels: slots holding no position are NaN
    ref_cache: torch.Tensor  # the same with those slots zero
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int


def paged_batch(shapes: list[tuple[int, int]], heads: tuple[int, int, int], dtype: torch.dtype, seed: int = 0):
    """A batch of sequences given as (cached tokens, new tokens), each on its own shuffled blocks."""
    num_heads, num_kv_heads, head_dim = heads
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(c + n) // BLOCK_SIZE) for c, n in shapes]
    num_blocks = sum(blocks_needed) + 2  # two spare blocks no table reaches
    order = torch.randperm(num_blocks, generator=g).tolist()
    width = max(blocks_needed) + 1
    tables, holds_position = [], torch.zeros(num_blocks, BLOCK_SIZE, dtype=torch.bool)
    for (cached, new), needed in zip(shapes, blocks_needed):
        own, order = order[:needed], order[needed:]
        for pos in range(cached + new):
            holds_position[own[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = True
        tables.append(own + [own[0]] * (width - needed))  # padding entries repeat a valid id
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=g).to(dtype)
    hidden = ~holds_position[None, :, :, None, None]
    num_tokens = sum(n for _, n in shapes)
    starts = [0]
    for _, n in shapes:
        starts.append(starts[-1] + n)
    as_long = {"dtype": torch.long, "device": DEVICE}
    return PagedBatch(
        q=randn(num_tokens, num_heads, head_dim, dtype=dtype, seed=seed + 1),
        cache=cache.masked_fill(hidden, float("nan")).to(DEVICE),
        ref_cache=cache.masked_fill(hidden, 0.0).to(DEVICE),
        query_start_loc=torch.tensor(starts, **as_long),
        seq_lens=torch.tensor([c + n for c, n in shapes], **as_long),
        block_tables=torch.tensor(tables, **as_long),
        max_query_len=max(n for _, n in shapes),
        max_seq_len=max(c + n for c, n in shapes),
    )


# Context lengths on both sides of cache-block (16) and key-tile (64) boundaries.
DECODE_LENGTHS = [1, 16, 17, 64, 65, 130]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits,window", [(None, None), (1, None), (3, 20)], ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=str)
def test_decode_attention_matches_reference(heads, num_splits, window, dtype):
    from kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref

    b = paged_batch([(n - 1, 1) for n in DECODE_LENGTHS], heads, dtype)
    scale = heads[2] ** -0.5
    with poisoned_allocations():
        out = paged_decode_attention(b.q, b.cache, b.seq_lens, b.block_tables, b.max_seq_len, scale, window,
                                     num_splits)
    ref = paged_decode_attention_ref(b.q, b.ref_cache, b.seq_lens, b.block_tables, b.max_seq_len, scale, window)
    assert_matches(out, ref)


# A fresh prompt, a decode, a chunk after a cached prefix crossing a block boundary, a one-token prompt,
# and a 70-token chunk (over one 64-query tile) after 33 cached tokens.
PREFILL_SHAPES = [(0, 37), (20, 1), (16, 9), (0, 1), (33, 70)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 20], ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=str)
def test_prefill_attention_matches_reference(heads, window, dtype):
    from kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref

    b = paged_batch(PREFILL_SHAPES, heads, dtype, seed=3)
    scale = heads[2] ** -0.5
    with poisoned_allocations():
        out = paged_prefill_attention(b.q, b.cache, b.query_start_loc, b.seq_lens, b.block_tables,
                                      b.max_query_len, scale, window)
    ref = paged_prefill_attention_ref(b.q, b.ref_cache, b.query_start_loc, b.seq_lens, b.block_tables,
                                      b.max_query_len, b.max_seq_len, scale, window)
    assert_matches(out, ref)


def model_inputs(shapes, heads, seed):
    """Metadata from the model's builder, plus new q, k, v and an empty cache."""
    from model.attention_metadata import AttentionMetadata

    num_heads, num_kv_heads, head_dim = heads
    per_seq = 9
    tables = [list(range(i * per_seq, (i + 1) * per_seq))[::-1] for i in range(len(shapes))]
    meta = AttentionMetadata.build([n for _, n in shapes], [c + n for c, n in shapes], tables, BLOCK_SIZE, DEVICE)
    num_tokens = sum(n for _, n in shapes)
    q = randn(num_tokens, num_heads, head_dim, seed=seed)
    k = randn(num_tokens, num_kv_heads, head_dim, seed=seed + 1)
    v = randn(num_tokens, num_kv_heads, head_dim, seed=seed + 2)
    cache = randn(2, len(shapes) * per_seq, BLOCK_SIZE, num_kv_heads, head_dim, seed=seed + 3)
    return meta, q, k, v, cache


@pytest.mark.parametrize("window", [None, 20], ids=str)
@pytest.mark.parametrize("shapes", [PREFILL_SHAPES, [(n - 1, 1) for n in DECODE_LENGTHS]], ids=["mixed", "decode"])
def test_backends_match_model_attention(shapes, window):
    """The reference and the Triton backend both compute what model.attention.TorchPagedAttention does."""
    from kernels.kv_cache import write_kv_cache_ref
    from kernels.paged_attention import paged_attention_ref
    from model.attention import TorchPagedAttention, TritonPagedAttention

    heads = (9, 3, 64)
    meta, q, k, v, cache = model_inputs(shapes, heads, seed=7)
    torch_backend = TorchPagedAttention(BLOCK_SIZE, window)
    model_cache = cache.clone()
    expected = torch_backend.forward(q, k, v, model_cache, torch_backend.plan(meta), 0.125)

    ref_cache = cache.clone()
    write_kv_cache_ref(k, v, ref_cache, meta.slot_mapping)
    assert torch.equal(ref_cache, model_cache)
    ref = paged_attention_ref(q, ref_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                              meta.max_query_len, meta.max_seq_len, 0.125, window)
    assert_matches(ref, expected)

    triton_backend = TritonPagedAttention(BLOCK_SIZE, window)
    triton_cache = cache.clone()
    out = triton_backend.forward(q, k, v, triton_cache, triton_backend.plan(meta), 0.125)
    assert torch.equal(triton_cache, model_cache)
    assert_matches(out, expected)


def test_attention_launchers_reject_bad_arguments():
    from kernels.decode_attention import paged_decode_attention
    from kernels.prefill_attention import paged_prefill_attention

    b = paged_batch([(3, 1), (20, 1)], (4, 2, 16), torch.float32)
    with pytest.raises(ValueError, match="not a multiple"):
        paged_decode_attention(b.q[:, :3], b.cache, b.seq_lens, b.block_tables, b.max_seq_len, 0.25)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(b.q[..., :8], b.cache, b.seq_lens, b.block_tables, b.max_seq_len, 0.25)
    with pytest.raises(ValueError, match="block_tables must have shape"):
        paged_decode_attention(b.q, b.cache, b.seq_lens, b.block_tables[:1], b.max_seq_len, 0.25)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention(b.q, b.cache, b.seq_lens.float(), b.block_tables, b.max_seq_len, 0.25)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_decode_attention(b.q, b.cache, b.seq_lens, b.block_tables, b.max_seq_len, 0.25, sliding_window=0)
    with pytest.raises(ValueError, match="query_start_loc must have shape"):
        paged_prefill_attention(b.q, b.cache, b.query_start_loc[:2], b.seq_lens, b.block_tables, 1, 0.25)
