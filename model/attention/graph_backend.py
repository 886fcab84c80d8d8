"""The Triton paged attention as one custom op (`ladder::triton_paged_attention`), for compiled models whose
steps are CUDA graphs.

`torch.compile` must not trace into the Triton launchers (their grids are Python numbers read from the
metadata), and a CUDA graph replays only what it recorded, so the op takes tensors alone and derives
every launch size from shapes, never from values: a replay with new sequence lengths stays correct.

- Decode (every sequence brings one token: T == S) runs the split-K decode kernel, its splits sized for
  the block table's width (the longest context the table can address), which the plan pads to a fixed
  width so one recorded graph serves a decode batch of that size at any length.
- Anything else runs the prefill kernel with max_query_len bounded by T - S + 1 (every sequence has at
  least one new token), which only sizes its grid.

The op writes the step's keys and values into the cache in place (`mutates_args`); its fake
implementation gives Inductor the output's shape and dtype. Under TRITON_INTERPRET=1 the same op runs
on CPU tensors (tests, `benchmarks/gpu_check.sh --dry-run`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.decode_attention import paged_decode_attention
from kernels.kv_cache import write_kv_cache
from kernels.prefill_attention import paged_prefill_attention
from model.attention.base import BaseAttention, refuse_sinks
from model.attention_metadata import AttentionMetadata


@dataclass(frozen=True)
class GraphAttentionPlan:
    """Only tensors, so one compiled graph (and one CUDA graph per batch shape) serves every step."""

    query_start_loc: torch.Tensor  # [S + 1] int64
    seq_lens: torch.Tensor  # [S] int64
    block_tables: torch.Tensor  # [S, width] int64, width fixed by the backend when it pads
    slot_mapping: torch.Tensor  # [T] int64


@torch.library.custom_op("ladder::triton_paged_attention", mutates_args=("kv_cache",))
def triton_paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: float,
    sliding_window: int,  # 0: none
) -> torch.Tensor:  # [T, heads, head_dim], contiguous
    write_kv_cache(k, v, kv_cache, slot_mapping)
    num_tokens, num_seqs = q.shape[0], seq_lens.shape[0]
    window = sliding_window or None
    if num_tokens == num_seqs:
        longest = block_tables.shape[1] * kv_cache.shape[2]
        return paged_decode_attention(q, kv_cache, seq_lens, block_tables, longest, scale, window)
    return paged_prefill_attention(q, kv_cache, query_start_loc, seq_lens, block_tables,
                                   max(1, num_tokens - num_seqs + 1), scale, window)


@triton_paged_attention.register_fake
def _(q, k, v, kv_cache, query_start_loc, seq_lens, block_tables, slot_mapping, scale, sliding_window):
    return q.new_empty(q.shape)


class GraphPagedAttention(BaseAttention):
    """`table_width`: blocks per row of every plan's block table (the most a sequence may own); None keeps
    the metadata's width (no CUDA graphs: a new width is only a new shape for a dynamic graph)."""

    def __init__(self, block_size: int, sliding_window: int | None = None, table_width: int | None = None) -> None:
        super().__init__(block_size, sliding_window)
        self.table_width = table_width

    def plan(self, meta: AttentionMetadata) -> GraphAttentionPlan:
        if meta.key_ends is not None:
            raise ValueError("images whose tokens see each other both ways (Gemma 3) need the eager model")
        tables = meta.block_tables
        if self.table_width is not None:
            if tables.shape[1] > self.table_width:
                raise ValueError(f"a block table of {tables.shape[1]} blocks exceeds the {self.table_width} "
                                 "this model was built for (max_model_len)")
            # Padding with block 0 is safe: columns past a sequence's length are never read.
            tables = torch.nn.functional.pad(tables, (0, self.table_width - tables.shape[1]))
        return GraphAttentionPlan(meta.query_start_loc, meta.seq_lens, tables, meta.slot_mapping)

    def forward(self, q, k, v, kv_cache, plan: GraphAttentionPlan, scale: float,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        refuse_sinks(self, sinks)
        return triton_paged_attention(q, k, v, kv_cache, plan.query_start_loc, plan.seq_lens, plan.block_tables,
                                      plan.slot_mapping, scale, self.sliding_window or 0)
