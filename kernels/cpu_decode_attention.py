"""Paged decode attention for the CPU: a small C++ kernel that reads each cached block in place.

The plain-torch path gathers every sequence's K and V blocks into a padded copy before attention;
on a CPU that copy is as expensive as the attention itself. This kernel walks the block table
instead, one (sequence, KV head) pair per task, with a float32 softmax over the whole context, so K
and V are read once and never copied. Grouped-query heads share each key they read.

The cache may hold float32, bfloat16 or float16; q and the output have the cache's dtype, or float32 over
a 16-bit cache (a float32 model whose KV cache is 16-bit: `--kv-cache-dtype`). A 16-bit element is widened
to float32 as it is loaded and every sum and the softmax run in float32, so a 16-bit cache computes what
the float32 kernel computes on the widened cache, rounded once at the output (a 16-bit q). It halves the
bytes read per token, which is what decode attention is bound by.

The common shapes (head size 64, 128 or 256, blocks of 16 tokens, up to 8 query heads per KV head) run a
specialised vector version: 16 (AVX-512) or 8 (AVX2) scores at once with one transposing reduction, a
vector exp, and software prefetch of the next block, since a sequence's blocks lie anywhere in the
cache and the hardware prefetcher cannot follow a block table. Other shapes run the portable loop.

`paged_decode_attention` is the custom op ladder::paged_decode_attention (kernels/csrc/decode_attention.cpp,
kernels/cpu_extension.py): the C++ kernel on CPU tensors where the extension builds, else its torch
reference (the gather path). `load()` says whether the kernel is there: callers that have a cheaper torch
path of their own take it when it is not.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import cpu_kernels_enabled, cpu_op, load
from kernels.paged_attention import paged_attention_ref

# What the kernel reads: a cache of one of these, and q (and the output) of its dtype or float32.
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def takes_dtypes(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    return cache_dtype in CACHE_DTYPES and q_dtype in (cache_dtype, torch.float32)


def has_avx512() -> bool:
    """Whether the build has the AVX-512 version (compiled for this machine's CPU with -march=native)."""
    module = load()
    return module is not None and module.has_avx512()


def is_enabled() -> bool:
    return cpu_kernels_enabled()


def check_decode_inputs(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor) -> None:
    """The C++ kernel reads raw host pointers: a tensor not on the CPU, or of another dtype or shape, is
    refused here with a ValueError. Index values (block ids, lengths) are the caller's invariant: the
    block manager hands out only blocks of the cache, and checking them would read every table on
    every layer."""
    if not (q.is_cpu and kv_cache.is_cpu and block_tables.is_cpu and seq_lens.is_cpu):
        named = (("q", q), ("kv_cache", kv_cache), ("block_tables", block_tables), ("seq_lens", seq_lens))
        where = ", ".join(f"{name} on {t.device}" for name, t in named)
        raise ValueError(f"the CPU decode attention kernel takes CPU tensors, got {where}")
    if not takes_dtypes(q.dtype, kv_cache.dtype):
        raise ValueError(f"a float32, bfloat16 or float16 kv_cache and q of its dtype or float32; got q {q.dtype} "
                         f"and kv_cache {kv_cache.dtype}")
    if q.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[4] != q.shape[2]:
        raise ValueError(f"expected q [S, H, D] and kv_cache [2, blocks, block_size, KVH, D], got "
                         f"{list(q.shape)} and {list(kv_cache.shape)}")
    if q.shape[1] % kv_cache.shape[3]:
        raise ValueError(f"{q.shape[1]} query heads do not group over {kv_cache.shape[3]} KV heads")
    num_seqs = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
        raise ValueError(f"expected block_tables [{num_seqs}, max_blocks] and seq_lens [{num_seqs}], got "
                         f"{list(block_tables.shape)} and {list(seq_lens.shape)}")


def paged_decode_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, scale: float, sliding_window: int,
                               portable: bool, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's reference: the gather path in float32, in q's dtype (`portable` is the kernel's alone)."""
    if q.shape[0] == 0:
        return torch.empty_like(q)
    starts = torch.arange(q.shape[0] + 1, device=q.device)
    return paged_attention_ref(q, kv_cache, starts, seq_lens, block_tables, 1, int(seq_lens.max()), scale,
                               sliding_window or None, sinks=sinks)


_paged_decode_attention = cpu_op("paged_decode_attention", paged_decode_attention_ref,
                                 lambda q, kv_cache, block_tables, seq_lens, scale, sliding_window, portable,
                                 sinks=None: torch.empty_like(q))


def paged_decode_attention(
    q: torch.Tensor,  # [S, H, D] one query token per sequence, of kv_cache's dtype or float32
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D] float32, bfloat16 or float16
    block_tables: torch.Tensor,  # [S, max_blocks] int64
    seq_lens: torch.Tensor,  # [S] int64
    scale: float,
    sliding_window: int | None = None,
    portable: bool = False,  # the portable loop even where a vector version exists
    sinks: torch.Tensor | None = None,  # [H] float32: each query head's sink logit (GPT-OSS)
) -> torch.Tensor:  # [S, H, D] of q's dtype, computed in float32
    check_decode_inputs(q, kv_cache, block_tables, seq_lens)
    if sinks is not None and (sinks.shape != (q.shape[1],) or not sinks.is_cpu):
        raise ValueError(f"sinks must be [{q.shape[1]}] on the CPU, one per query head; got {list(sinks.shape)} "
                         f"on {sinks.device}")
    return _paged_decode_attention(q, kv_cache, block_tables.long(), seq_lens.long(), scale, sliding_window or 0,
                                   portable, None if sinks is None else sinks.float().contiguous())
