"""The C++ CPU decode attention against the plain-torch reference, and inside the model."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_decode_attention as kernel
from kernels.paged_attention import paged_attention_ref

pytestmark = pytest.mark.skipif(kernel.load() is None, reason="the CPU kernel could not be built here "
                                "(a C++ compiler and ninja are needed); the torch path is used instead")


@pytest.mark.parametrize("num_seqs,max_len,num_heads,num_kv_heads,head_dim,window", [
    (1, 1, 4, 4, 16, None),
    (5, 37, 8, 2, 32, None),
    (7, 100, 9, 3, 64, None),  # the default model's heads
    (3, 64, 12, 1, 64, None),
    (4, 90, 4, 4, 16, 10),
    (6, 33, 8, 4, 128, 16),
    # The AVX-512 version's shapes: 8 query heads per KV head, windows starting inside a block.
    (5, 300, 8, 1, 64, None),
    (4, 200, 6, 2, 64, 37),
    (3, 50, 4, 2, 128, None),
])
@pytest.mark.parametrize("portable", [False, True], ids=["fast", "portable"])
def test_decode_kernel_matches_reference(num_seqs, max_len, num_heads, num_kv_heads, head_dim, window, portable):
    gen = torch.Generator().manual_seed(num_seqs * 100 + max_len)
    block_size = 16
    blocks_per_seq = -(-max_len // block_size) + 1
    num_blocks = num_seqs * blocks_per_seq + 3
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:blocks_per_seq] for _ in range(num_seqs)])
    seq_lens = torch.randint(1, max_len + 1, (num_seqs,), generator=gen)
    seq_lens[0] = max_len  # block boundaries and odd lengths both occur
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen)
    ref = paged_attention_ref(q, cache, torch.arange(num_seqs + 1), seq_lens, tables, 1, int(seq_lens.max()),
                              head_dim**-0.5, window)
    out = kernel.paged_decode_attention(q, cache, tables, seq_lens, head_dim**-0.5, window, portable=portable)
    assert not out.isnan().any()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize("head_dim", [64, 128, 32])
@pytest.mark.parametrize("portable", [False, True], ids=["fast", "portable"])
def test_ignores_slots_past_the_sequence(head_dim, portable):
    """The unused tail of a sequence's last block may hold anything (here NaN): it must not leak in."""
    block_size, lens = 16, [5, 16, 21, 40]
    cache = torch.full((2, 12, block_size, 2, head_dim), float("nan"))
    tables = torch.arange(12).view(4, 3)
    for s, n in enumerate(lens):
        for pos in range(n):
            cache[:, tables[s, pos // block_size], pos % block_size] = torch.randn(2, 2, head_dim)
    seq_lens = torch.tensor(lens)
    q = torch.randn(4, 6, head_dim)
    ref = paged_attention_ref(q, cache.nan_to_num(0.0), torch.arange(5), seq_lens, tables, 1, 40,
                              head_dim**-0.5, None)
    out = kernel.paged_decode_attention(q, cache, tables, seq_lens, head_dim**-0.5, portable=portable)
    assert not out.isnan().any()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5


def test_rejects_what_it_cannot_run():
    q = torch.randn(2, 6, 16)
    cache = torch.randn(2, 4, 16, 4, 16)
    with pytest.raises(ValueError, match="group"):
        kernel.paged_decode_attention(q, cache, torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long),
                                      0.25)
    with pytest.raises(ValueError, match="float32"):
        kernel.paged_decode_attention(q.half(), cache.half(), torch.zeros(2, 1, dtype=torch.long),
                                      torch.ones(2, dtype=torch.long), 0.25)
