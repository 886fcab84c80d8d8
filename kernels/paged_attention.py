"""The reference for attention over a paged KV cache, and the checks its kernels share.

Semantics: the flat batch holds the new tokens of S sequences end to end, sequence s owning rows
query_start_loc[s]:query_start_loc[s+1]. Its seq_lens[s] tokens (cached context, then the new ones,
already written to the cache) sit at positions 0..seq_len-1, token p in block
block_tables[s, p // block_size] at row p % block_size. New token i of sequence s is at position
seq_lens[s] - num_new[s] + i and attends causally to positions <= its own, and with a sliding window w
only to positions > its own - w. With `key_ends` [T], new token t attends to positions < key_ends[t] instead
of <= its own (an image's tokens see the whole image: Gemma 3); a window still counts back from its own
position. Queries may have more heads than the cache (grouped-query attention:
query head h reads KV head h // (num_heads / num_kv_heads)). With `sinks` [num_heads] (GPT-OSS), each query
head's softmax has one more logit, its sink, that takes weight without a value: the attention's output is
scaled by sum_t exp(s_t) / (sum_t exp(s_t) + exp(sink)).

Decode (one new token per sequence) and prefill chunks compute the same function; their kernels live
in decode_attention.py and prefill_attention.py. `plan_gather` and `gathered_attention` are that function
in plain torch, split so a model builds the plan once per step and every layer reuses it: the model's
torch attention backend, the ONNX export and `paged_attention_ref` all run them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.kv_cache import check_kv_cache
from kernels.kv_layout import blocks_for_tokens
from kernels.runtime import FLOAT_DTYPES, INDEX_DTYPES, check_tensor


class GatherPlan(NamedTuple):
    """Index tensors that turn a flat batch into a padded [S, max_q] grid of queries over each
    sequence's gathered blocks; built once per step and shared by every layer."""

    query_index: torch.Tensor  # [S, max_q] flat row of each padded query (0 where padding)
    output_index: torch.Tensor  # [T] where each flat row sits in the padded grid flattened to [S * max_q]
    block_tables: torch.Tensor  # [S, NB] only the blocks the longest sequence needs
    mask: torch.Tensor  # [S, 1, max_q, NB * block_size] bool, True = may attend


def plan_gather(
    query_start_loc: torch.Tensor,  # [S + 1]
    seq_lens: torch.Tensor,  # [S]
    block_tables: torch.Tensor,  # [S, max_blocks]
    max_query_len: int,
    max_seq_len: int,
    block_size: int,
    sliding_window: int | None = None,
    key_ends: torch.Tensor | None = None,  # [T] keys each new token sees; None: causal
) -> GatherPlan:
    device = seq_lens.device
    query_lens = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    rows = torch.arange(max_query_len, device=device)  # [max_q]
    query_valid = rows[None, :] < query_lens[:, None]
    query_index = torch.where(query_valid, query_start_loc[:-1, None] + rows[None, :], 0)
    # At least two blocks (when the tables have them), so the plan's tables never have a row stride of 1:
    # compilers specialize on it. The extra block is masked out like any slot past a sequence's end.
    num_blocks = min(max(2, blocks_for_tokens(max_seq_len, block_size)), block_tables.shape[1])
    keys = torch.arange(num_blocks * block_size, device=device)  # [L]
    # Absolute position of each padded query; causality then also hides slots past seq_len.
    query_pos = (seq_lens - query_lens)[:, None] + rows[None, :]  # [S, max_q]
    key_end = query_pos + 1 if key_ends is None else torch.where(query_valid, key_ends[query_index], query_pos + 1)
    mask = keys[None, None, :] < key_end[:, :, None]
    if sliding_window is not None:
        mask &= keys[None, None, :] > query_pos[:, :, None] - sliding_window
    # An index, not a boolean mask, so the output's shape [T] is known without reading the data
    # (exporters and compilers get the plan as inputs).
    output_index = torch.nonzero(query_valid.flatten()).squeeze(1)
    return GatherPlan(query_index, output_index, block_tables[:, :num_blocks].contiguous(), mask[:, None])


def gathered_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], this step's tokens written
    plan: GatherPlan,
    scale: float,
    heads_by_reshape: bool = False,
    sinks: torch.Tensor | None = None,  # [num_heads] float32: each query head's sink logit
) -> torch.Tensor:  # [T, num_heads, head_dim] of q's dtype
    """Attention of the flat batch's queries over their sequences' cached blocks, gathered.

    heads_by_reshape: lay the query heads that share a KV head side by side (explicit matmuls, softmax in
    float32) instead of SDPA's `enable_gqa`; the same function, written so an exporter neither repeats
    K/V heads nor needs an SDPA with grouped heads. Sinks take that path too (SDPA has no sink column)."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    num_heads = q.shape[1]
    num_seqs, max_q = plan.query_index.shape
    # [S, NB, bs, kvh, d] -> [S, kvh, L, d]
    keys = kv_cache[0][plan.block_tables].reshape(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = kv_cache[1][plan.block_tables].reshape(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    if not heads_by_reshape and sinks is None:
        queries = q[plan.query_index].transpose(1, 2)  # [S, H, max_q, d]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=plan.mask, scale=scale,
                                             enable_gqa=num_kv_heads != num_heads)
        out = out.transpose(1, 2).reshape(-1, num_heads, head_dim)  # [S * max_q, H, d]
        return out[plan.output_index]
    group = num_heads // num_kv_heads
    # Queries [S, Q, H, d] -> [S, kvh, Q * group, d]: the heads sharing a kv head side by side.
    queries = q[plan.query_index].reshape(num_seqs, max_q, num_kv_heads, group, head_dim)
    queries = queries.permute(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, max_q * group, head_dim)
    scores = torch.matmul(queries, keys.transpose(2, 3)).float() * scale  # [S, kvh, Q * group, L]
    scores = scores.reshape(num_seqs, num_kv_heads, max_q, group, -1)
    scores = scores.masked_fill(~plan.mask[:, :, :, None, :], float("-inf"))  # mask [S, 1, Q, 1, L]
    if sinks is not None:  # one more column per head, [1, kvh, 1, group, 1], dropped after the softmax
        sink = sinks.float().view(1, num_kv_heads, 1, group, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = probs.to(q.dtype).reshape(num_seqs, num_kv_heads, max_q * group, -1)
    out = torch.matmul(probs, values)  # [S, kvh, Q * group, d]
    out = out.reshape(num_seqs, num_kv_heads, max_q, group, head_dim).permute(0, 2, 1, 3, 4)
    return out.reshape(num_seqs * max_q, num_heads, head_dim)[plan.output_index]


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
    key_ends: torch.Tensor | None = None,  # [T]; None: causal
    sinks: torch.Tensor | None = None,  # [num_heads]; None: no sinks
) -> torch.Tensor:  # [T, num_heads, head_dim] of q's dtype, computed in float32
    """What every paged attention kernel must compute (the cache already holds this step's tokens)."""
    plan = plan_gather(query_start_loc, seq_lens, block_tables, max_query_len, max_seq_len, kv_cache.shape[2],
                       sliding_window, key_ends)
    return gathered_attention(q.float(), kv_cache.float(), plan, scale, sinks=sinks).to(q.dtype)


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
