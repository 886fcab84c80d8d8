"""The reference attention with decode steps on the C++ kernel (`kernels/cpu_decode_attention.py`), which
reads cached blocks in place instead of gathering them."""

from __future__ import annotations

import torch

from kernels import cpu_decode_attention as cpu_kernel
from kernels.kv_cache import write_kv_cache_ref
from model.attention.torch_backend import TorchAttentionPlan, TorchPagedAttention


class CpuPagedAttention(TorchPagedAttention):
    """Decode steps whose cache dtype the kernel takes (it computes in float32) run on it; anything else,
    and a machine where the kernel does not build, runs the reference."""

    def forward(self, q, k, v, kv_cache, plan: TorchAttentionPlan, scale: float) -> torch.Tensor:
        if (plan.is_decode and kv_cache.dtype in cpu_kernel.CACHE_DTYPES and q.dtype == kv_cache.dtype
                and cpu_kernel.load()):
            write_kv_cache_ref(k, v, kv_cache, plan.slot_mapping)
            return cpu_kernel.paged_decode_attention(q, kv_cache, plan.block_tables, plan.seq_lens, scale,
                                                     self.sliding_window)
        return super().forward(q, k, v, kv_cache, plan, scale)
