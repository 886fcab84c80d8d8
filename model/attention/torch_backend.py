"""The reference attention: plain torch (`kernels/paged_attention.py`), runs anywhere, and defines what
every other backend computes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.kv_cache import write_kv_cache_ref
from kernels.paged_attention import GatherPlan, gathered_attention, plan_gather
from model.attention.base import BaseAttention
from model.attention_metadata import AttentionMetadata


@dataclass(frozen=True)
class TorchAttentionPlan:
    """The reference's plan (`kernels.paged_attention.GatherPlan`) and where the new tokens are written.

    Only tensors: one compiled or exported graph then serves every batch shape."""

    query_index: torch.Tensor  # [S, max_q]
    output_index: torch.Tensor  # [T]
    block_tables: torch.Tensor  # [S, num_blocks] only the blocks the longest sequence needs
    mask: torch.Tensor  # [S, 1, max_q, num_blocks * block_size] bool, True = may attend
    slot_mapping: torch.Tensor  # [T]
    seq_lens: torch.Tensor  # [S]

    @property
    def gather(self) -> GatherPlan:
        return GatherPlan(self.query_index, self.output_index, self.block_tables, self.mask)

    @property
    def is_decode(self) -> bool:
        """Every sequence brings exactly one new token."""
        return self.query_index.shape[1] == 1


class TorchPagedAttention(BaseAttention):
    """Gathers each sequence's cached blocks and runs SDPA over them under the plan's mask."""

    def plan(self, meta: AttentionMetadata) -> TorchAttentionPlan:
        gather = plan_gather(meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.max_query_len,
                             meta.max_seq_len, self.block_size, self.sliding_window, meta.key_ends)
        return TorchAttentionPlan(*gather, slot_mapping=meta.slot_mapping, seq_lens=meta.seq_lens)

    def forward(self, q, k, v, kv_cache, plan: TorchAttentionPlan, scale: float,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        write_kv_cache_ref(k, v, kv_cache, plan.slot_mapping)
        return gathered_attention(q, kv_cache, plan.gather, scale, sinks=sinks)
