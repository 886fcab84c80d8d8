"""The CPU attention behind one custom op (`ladder::paged_attention`), so `torch.compile` and AOTInductor
neither trace nor break on it: compiled CPU artifacts call it as one opaque step per layer."""

from __future__ import annotations

import torch

from model.attention.base import refuse_sinks
from model.attention.cpu_backend import CpuPagedAttention
from model.attention.torch_backend import TorchAttentionPlan, TorchPagedAttention


@torch.library.custom_op("ladder::paged_attention", mutates_args=("kv_cache",))
def paged_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
    query_index: torch.Tensor, output_index: torch.Tensor, block_tables: torch.Tensor, mask: torch.Tensor,
    slot_mapping: torch.Tensor, seq_lens: torch.Tensor, scale: float, block_size: int, sliding_window: int,
) -> torch.Tensor:
    """CpuPagedAttention.forward with the plan spelled out as tensors (custom ops take no dataclasses);
    `sliding_window` 0 means none."""
    plan = TorchAttentionPlan(query_index, output_index, block_tables, mask, slot_mapping, seq_lens)
    return CpuPagedAttention(block_size, sliding_window or None).forward(q, k, v, kv_cache, plan, scale)


@paged_attention_op.register_fake
def _(q, k, v, kv_cache, *rest) -> torch.Tensor:
    return torch.empty_like(q)


class OpaquePagedAttention(TorchPagedAttention):
    """The reference's plan; the forward is the custom op."""

    def forward(self, q, k, v, kv_cache, plan: TorchAttentionPlan, scale: float,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        refuse_sinks(self, sinks)
        return paged_attention_op(q, k, v, kv_cache, plan.query_index, plan.output_index, plan.block_tables,
                                  plan.mask, plan.slot_mapping, plan.seq_lens, scale, self.block_size,
                                  self.sliding_window or 0)
