"""Paged attention for prefill chunks: causal, variable lengths, after any amount of cached context.

Each program takes BLOCK_M consecutive new tokens of one sequence and one query head, and scans the
sequence's cached positions up to the last of those tokens, BLOCK_N at a time through the block table,
with an online softmax in float32 (flash attention over a paged cache). The chunk's own keys and values
are read from the cache too, so they must be written there first. Any query length works, so a batch
that mixes decodes and prefill chunks runs here in one launch.
"""

from __future__ import annotations

import math

import torch

from kernels.paged_attention import check_paged_inputs, check_window, paged_attention_ref
from kernels.runtime import (
    HAS_TRITON,
    INDEX_DTYPES,
    check_devices,
    check_tensor,
    dot_dtype,
    dot_precision,
    next_power_of_2,
    require_triton,
    tl,
    triton,
)

LOG2_E = math.log2(math.e)

paged_prefill_attention_ref = paged_attention_ref


if HAS_TRITON:
    # Finite, so a split or row with nothing to attend to merges without inf - inf.
    NEG_INF = tl.constexpr(-1.0e30)

    @triton.jit
    def _prefill_kernel(
        q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, out_ptr,
        scale_log2, window,
        stride_qt, stride_qh, stride_c_kv, stride_c_block, stride_c_slot, stride_c_head, stride_bt,
        stride_ot, stride_oh,
        block_size, group, head_dim,
        SLIDING: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        seq = tl.program_id(0).to(tl.int64)
        m_block = tl.program_id(1)
        head = tl.program_id(2)
        q_start = tl.load(query_start_ptr + seq).to(tl.int64)
        q_len = (tl.load(query_start_ptr + seq + 1) - q_start).to(tl.int32)
        if m_block * BLOCK_M < q_len:
            seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
            context = seq_len - q_len
            rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
            row_mask = rows < q_len
            q_pos = context + rows
            d = tl.arange(0, BLOCK_D)
            d_mask = d < head_dim
            q_rows = (q_start + rows) * stride_qt + head * stride_qh
            q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=row_mask[:, None] & d_mask[None, :],
                        other=0.0).to(DOT_DTYPE)

            # Keys past the block's last query are hidden by causality; with a window, so are keys
            # before its first query's window.
            end = tl.minimum(seq_len, context + (m_block + 1) * BLOCK_M)
            start = 0
            if SLIDING:
                start = (tl.maximum(context + m_block * BLOCK_M - window + 1, 0) // BLOCK_N) * BLOCK_N
            m = tl.full([BLOCK_M], NEG_INF, tl.float32)
            l = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            kv_base = cache_ptr + (head // group) * stride_c_head
            for n0 in range(start, end, BLOCK_N):
                pos = n0 + tl.arange(0, BLOCK_N)
                valid = pos < end
                block = tl.load(block_tables_ptr + seq * stride_bt + pos // block_size, mask=valid,
                                other=0).to(tl.int64)
                kv_rows = block * stride_c_block + (pos % block_size) * stride_c_slot
                kv_mask = valid[:, None] & d_mask[None, :]
                k = tl.load(kv_base + kv_rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
                allowed = valid[None, :] & (pos[None, :] <= q_pos[:, None])
                if SLIDING:
                    allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
                s = tl.where(allowed, s, NEG_INF)
                m_new = tl.maximum(m, tl.max(s, axis=1))
                alpha = tl.exp2(m - m_new)
                p = tl.where(allowed, tl.exp2(s - m_new[:, None]), 0.0)
                l = l * alpha + tl.sum(p, axis=1)
                v = tl.load(kv_base + stride_c_kv + kv_rows[:, None] + d[None, :], mask=kv_mask,
                            other=0.0).to(DOT_DTYPE)
                acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
                m = m_new
            out = acc / tl.where(l > 0.0, l, 1.0)[:, None]
            out_rows = (q_start + rows) * stride_ot + head * stride_oh
            tl.store(out_ptr + out_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=row_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Triton paged_attention_ref over a flat batch. q [T, H, D] (heads and tokens at any stride) -> new [T, H, D].

    max_query_len must bound the query lengths (it sizes the grid without reading them on the host).
    """
    require_triton()
    num_heads, _, head_dim, group = check_paged_inputs(q, kv_cache, seq_lens, block_tables)
    num_seqs = seq_lens.shape[0]
    check_tensor("query_start_loc", query_start_loc, shape=[num_seqs + 1], dtypes=INDEX_DTYPES)
    window = check_window(sliding_window)
    device = check_devices(q=q, kv_cache=kv_cache, query_start_loc=query_start_loc, seq_lens=seq_lens,
                           block_tables=block_tables)
    out = torch.empty(q.shape, dtype=q.dtype, device=device)
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    block_m = 64 if max_query_len > 32 else 16 if max_query_len <= 16 else 32
    block_n = 64
    grid = (num_seqs, triton.cdiv(max_query_len, block_m), num_heads)
    _prefill_kernel[grid](
        q, kv_cache, block_tables, seq_lens, query_start_loc, out,
        scale * LOG2_E, window,
        q.stride(0), q.stride(1), *kv_cache.stride()[:4], block_tables.stride(0),
        out.stride(0), out.stride(1),
        kv_cache.shape[2], group, head_dim,
        SLIDING=window > 0, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, next_power_of_2(head_dim)),
        DOT_DTYPE=dot_dtype(q.dtype), DOT_PRECISION=dot_precision(q.dtype),
        num_warps=4, num_stages=2,
    )
    return out
