"""The reference for attention over a paged KV cache, and the checks its kernels share.

Semantics (those of `model.attention.TorchPagedAttention`): the flat batch holds the new tokens of S
sequences end to end, sequence s owning rows query_start_loc[s]:query_start_loc[s+1]. Its seq_lens[s]
tokens (cached context, then the new ones, already written to the cache) sit at positions 0..seq_len-1,
token p in block block_tables[s, p // block_size] at row p % block_size. New token i of sequence s is at
position seq_lens[s] - num_new[s] + i and attends causally to positions <= its own, and with a sliding
window w only to positions > its own - w. Queries may have more heads than the cache (grouped-query
attention: query head h reads KV head h // (num_heads / num_kv_heads)).

Decode (one new token per sequence) and prefill chunks compute the same function; their kernels live
in decode_attention.py and prefill_attention.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.kv_cache import check_kv_cache
from kernels.runtime import FLOAT_DTYPES, INDEX_DTYPES, check_tensor


def paged_attention_ref(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [S + 1]
    seq_lens: torch.Tensor,  # [S]
    block_tables: torch.Tensor,  # [S, max_blocks]
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim] of q's dtype, computed in float32
    num_tokens = q.shape[0]
    block_size = kv_cache.shape[2]
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    num_seqs = seq_lens.shape[0]
    starts = query_start_loc[:-1]
    query_lens = query_start_loc[1:] - starts  # [S]
    rows = torch.arange(max_query_len, device=q.device)  # [max_q]
    # Pad queries into a [S, max_q] grid; padding rows repeat row 0 and are dropped at the end.
    query_index = torch.where(rows[None, :] < query_lens[:, None], starts[:, None] + rows[None, :], 0)
    num_blocks = -(-max_seq_len // block_size)
    tables = block_tables[:, :num_blocks]
    keys = kv_cache[0][tables].reshape(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    values = kv_cache[1][tables].reshape(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    key_pos = torch.arange(num_blocks * block_size, device=q.device)  # [L]
    query_pos = (seq_lens - query_lens)[:, None] + rows[None, :]  # [S, max_q]
    # Causality also hides slots past seq_len, since no query sits beyond its sequence's end.
    mask = key_pos[None, None, :] <= query_pos[:, :, None]  # [S, max_q, L]
    if sliding_window is not None:
        mask &= key_pos[None, None, :] > query_pos[:, :, None] - sliding_window
    out = F.scaled_dot_product_attention(
        q[query_index].transpose(1, 2).float(),  # [S, H, max_q, d]
        keys.transpose(1, 2).float(),  # [S, kvh, L, d]
        values.transpose(1, 2).float(),
        attn_mask=mask[:, None], scale=scale, enable_gqa=num_kv_heads != q.shape[1],
    ).transpose(1, 2)  # [S, max_q, H, d]
    # Back to the flat batch without a host sync: token t is row t - starts[s] of its sequence s.
    tokens = torch.arange(num_tokens, device=q.device)
    seq_of_token = torch.searchsorted(query_start_loc[1:], tokens, right=True)
    return out[seq_of_token, tokens - starts[seq_of_token]].to(q.dtype)


def check_paged_inputs(
    q: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor
) -> tuple[int, int, int, int]:
    """Shapes, dtypes and layouts both attention kernels need; returns (num_heads, num_kv_heads, head_dim, group)."""
    check_kv_cache(kv_cache)
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} differs from the cache's {head_dim}")
    num_heads = q.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"q has {num_heads} heads, not a multiple of the cache's {num_kv_heads} KV heads")
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES)
    check_tensor("block_tables", block_tables, shape=[seq_lens.shape[0], None], dtypes=INDEX_DTYPES)
    return num_heads, num_kv_heads, head_dim, num_heads // num_kv_heads


def check_window(sliding_window: int | None) -> int:
    """The window as the kernels take it: 0 for none."""
    if sliding_window is None:
        return 0
    if sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    return sliding_window
