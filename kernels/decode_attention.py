"""Paged attention for decode: one new token per sequence, split-K over the cached context.

Each program takes one (sequence, KV head, split): the query heads that share the KV head are processed
together (grouped-query attention reads each key once for the whole group), and the split's range of
positions is scanned with an online softmax in float32. A second kernel merges the splits' partial
results by their running maxima and sums. Short batches on a big GPU get more splits, so every SM has
work; with one split the first kernel writes the output directly.
"""

from __future__ import annotations

import functools
import math

import torch

from kernels.paged_attention import check_paged_inputs, check_window, paged_attention_ref
from kernels.runtime import (
    HAS_TRITON,
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


def paged_decode_attention_ref(
    q: torch.Tensor,  # [S, num_heads, head_dim]: the one new token of each sequence
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    query_start_loc = torch.arange(q.shape[0] + 1, device=q.device)
    return paged_attention_ref(q, kv_cache, query_start_loc, seq_lens, block_tables, 1, max_seq_len, scale,
                               sliding_window)


if HAS_TRITON:
    # Finite, so a split or row with nothing to attend to merges without inf - inf.
    NEG_INF = tl.constexpr(-1.0e30)

    @triton.jit
    def _decode_split_kernel(
        q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_stats_ptr,
        scale_log2, window,
        stride_qs, stride_qh, stride_c_kv, stride_c_block, stride_c_slot, stride_c_head, stride_bt,
        stride_os, stride_oh,
        block_size, tokens_per_split, num_splits, num_heads, group, head_dim, stats_plane,
        SLIDING: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        seq = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
        g = tl.arange(0, BLOCK_G)
        heads = kv_head * group + g
        g_mask = g < group
        d = tl.arange(0, BLOCK_D)
        d_mask = d < head_dim
        q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)

        start = split * tokens_per_split
        end = tl.minimum(start + tokens_per_split, seq_len)
        if SLIDING:  # the query at seq_len - 1 sees positions >= seq_len - window
            start = tl.maximum(start, (tl.maximum(seq_len - window, 0) // BLOCK_N) * BLOCK_N)
        m = tl.full([BLOCK_G], NEG_INF, tl.float32)  # running max of scores (log2 units)
        l = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2(score - m)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        kv_base = cache_ptr + kv_head * stride_c_head
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            valid = pos < end
            if SLIDING:
                valid = valid & (pos >= seq_len - window)
            block = tl.load(block_tables_ptr + seq * stride_bt + pos // block_size, mask=valid, other=0).to(tl.int64)
            rows = block * stride_c_block + (pos % block_size) * stride_c_slot
            kv_mask = valid[:, None] & d_mask[None, :]
            k = tl.load(kv_base + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
            s = tl.where(valid[None, :], s, NEG_INF)
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.where(valid[None, :], tl.exp2(s - m_new[:, None]), 0.0)
            l = l * alpha + tl.sum(p, axis=1)
            v = tl.load(kv_base + stride_c_kv + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(DOT_DTYPE)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
            m = m_new

        out_mask = g_mask[:, None] & d_mask[None, :]
        if SINGLE_SPLIT:
            out = acc / tl.where(l > 0.0, l, 1.0)[:, None]
            tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            # part_out [S, H, splits, head_dim] and part_stats [2, S, H, splits] (max, then sum), float32.
            slot = (seq * num_heads + heads) * num_splits + split
            tl.store(part_out_ptr + slot[:, None] * head_dim + d[None, :], acc, mask=out_mask)
            tl.store(part_stats_ptr + slot, m, mask=g_mask)
            tl.store(part_stats_ptr + stats_plane + slot, l, mask=g_mask)

    @triton.jit
    def _decode_merge_kernel(
        part_out_ptr, part_stats_ptr, out_ptr, stride_os, stride_oh,
        num_heads, num_splits, head_dim, stats_plane,
        BLOCK_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        seq = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        splits = tl.arange(0, BLOCK_SPLITS)
        s_mask = splits < num_splits
        d = tl.arange(0, BLOCK_D)
        d_mask = d < head_dim
        slot = (seq * num_heads + head) * num_splits + splits
        m = tl.load(part_stats_ptr + slot, mask=s_mask, other=NEG_INF)
        l = tl.load(part_stats_ptr + stats_plane + slot, mask=s_mask, other=0.0)
        weight = tl.exp2(m - tl.max(m, axis=0))  # empty splits: exp2(-1e30 - max) = 0
        total = tl.sum(weight * l, axis=0)
        acc = tl.load(part_out_ptr + slot[:, None] * head_dim + d[None, :],
                      mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        out = tl.sum(acc * weight[:, None], axis=0) / total
        tl.store(out_ptr + seq * stride_os + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def default_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Enough (sequence, KV head, split) programs for two waves over the SMs, at least 256 positions each."""
    programs = max(1, num_seqs * num_kv_heads)
    wanted = -(-2 * _num_sms(device) // programs)
    return max(1, min(wanted, -(-max_seq_len // 256)))


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton paged_decode_attention_ref. q [S, H, D] (heads and tokens at any stride) -> new [S, H, D].

    max_seq_len must bound seq_lens (it sizes the splits without reading seq_lens on the host).
    """
    require_triton()
    num_heads, num_kv_heads, head_dim, group = check_paged_inputs(q, kv_cache, seq_lens, block_tables)
    num_seqs = q.shape[0]
    check_tensor("seq_lens", seq_lens, shape=[num_seqs])
    window = check_window(sliding_window)
    device = check_devices(q=q, kv_cache=kv_cache, seq_lens=seq_lens, block_tables=block_tables)
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=q.dtype, device=device)
    if num_seqs == 0 or max_seq_len <= 0:
        return out.zero_()
    block_n = 64
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, max_seq_len, device)
    # Splits cover whole tiles of block_n positions; recount them after rounding.
    tokens_per_split = -(-max_seq_len // (num_splits * block_n)) * block_n
    num_splits = -(-max_seq_len // tokens_per_split)
    if num_splits > 1:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=device)
        part_stats = torch.empty(2, num_seqs, num_heads, num_splits, dtype=torch.float32, device=device)
    else:
        part_out = part_stats = out  # not read
    block_d = max(16, next_power_of_2(head_dim))
    stats_plane = num_seqs * num_heads * num_splits
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, kv_cache, block_tables, seq_lens, out, part_out, part_stats,
        scale * LOG2_E, window,
        q.stride(0), q.stride(1), *kv_cache.stride()[:4], block_tables.stride(0),
        out.stride(0), out.stride(1),
        kv_cache.shape[2], tokens_per_split, num_splits, num_heads, group, head_dim, stats_plane,
        SLIDING=window > 0, SINGLE_SPLIT=num_splits == 1,
        BLOCK_G=max(16, next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        DOT_DTYPE=dot_dtype(q.dtype), DOT_PRECISION=dot_precision(q.dtype),
        num_warps=4, num_stages=2,
    )
    if num_splits > 1:
        _decode_merge_kernel[(num_seqs, num_heads)](
            part_out, part_stats, out, out.stride(0), out.stride(1),
            num_heads, num_splits, head_dim, stats_plane,
            BLOCK_SPLITS=next_power_of_2(num_splits), BLOCK_D=block_d, num_warps=4,
        )
    return out
