"""Attention on the Triton decode and prefill kernels, launched from Python per layer (eager models)."""

from __future__ import annotations

import torch

from kernels.decode_attention import paged_decode_attention
from kernels.kv_cache import write_kv_cache
from kernels.paged_attention import paged_attention_ref
from kernels.prefill_attention import paged_prefill_attention
from model.attention.base import BaseAttention, refuse_sinks
from model.attention_metadata import AttentionMetadata


class TritonPagedAttention(BaseAttention):
    """Its plan is the metadata itself: the kernels read it directly, and its Python numbers
    (max_query_len, max_seq_len) size their grids."""

    def plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        return meta

    def forward(self, q, k, v, kv_cache, plan: AttentionMetadata, scale: float,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        refuse_sinks(self, sinks)
        if kv_cache.shape[2] != self.block_size:
            raise ValueError(f"kv_cache block size {kv_cache.shape[2]} differs from the model's {self.block_size}")
        write_kv_cache(k, v, kv_cache, plan.slot_mapping)
        if plan.key_ends is not None:  # images that see themselves both ways (a prefill): the reference's mask
            return paged_attention_ref(q, kv_cache, plan.query_start_loc, plan.seq_lens, plan.block_tables,
                                       plan.max_query_len, plan.max_seq_len, scale, self.sliding_window,
                                       plan.key_ends)
        if plan.max_query_len == 1:  # every sequence brings one token: pure decode
            return paged_decode_attention(q, kv_cache, plan.seq_lens, plan.block_tables, plan.max_seq_len, scale,
                                          self.sliding_window)
        return paged_prefill_attention(q, kv_cache, plan.query_start_loc, plan.seq_lens, plan.block_tables,
                                       plan.max_query_len, scale, self.sliding_window)
