"""The reference attention written for export (`compile/onnx_export.py` traces a step with it).

The cache update is functional: the updated cache is a new tensor, recorded in `updated` for the exporter
to return as a graph output (ONNX has no in-place writes to graph inputs; the runtime binds the output to
the input's buffer instead). Grouped-query attention is a reshape of the queries instead of SDPA's
`enable_gqa` (no repeated K/V heads are materialised): the reference's `heads_by_reshape` form, in the
query's dtype with the softmax in float32. Plain torch only: no exporter is imported here.
"""

from __future__ import annotations

import torch

from kernels.paged_attention import gathered_attention
from model.attention.base import refuse_sinks
from model.attention.torch_backend import TorchAttentionPlan, TorchPagedAttention


class ExportPagedAttention(TorchPagedAttention):
    """The reference's plan; `forward` returns the attention and appends the layer's new cache to
    `updated` (one entry per layer, in call order; the exporter clears it before each trace)."""

    def __init__(self, block_size: int, sliding_window: int | None = None) -> None:
        super().__init__(block_size, sliding_window)
        self.updated: list[torch.Tensor] = []

    def forward(self, q, k, v, kv_cache, plan: TorchAttentionPlan, scale: float,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        refuse_sinks(self, sinks)
        block_size = kv_cache.shape[2]
        # One ScatterND into the 5-d cache: rows (0|1, block, offset) get the new keys, then values.
        slots = plan.slot_mapping
        which = torch.cat([torch.zeros_like(slots), torch.ones_like(slots)])
        blocks = torch.cat([slots // block_size, slots // block_size])
        offsets = torch.cat([slots % block_size, slots % block_size])
        new_kv = torch.cat([k, v]).to(kv_cache.dtype)  # [2T, kvh, d]
        kv_cache = kv_cache.index_put((which, blocks, offsets), new_kv)
        self.updated.append(kv_cache)
        return gathered_attention(q, kv_cache, plan.gather, scale, heads_by_reshape=True)
