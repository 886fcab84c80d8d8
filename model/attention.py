"""Attention backends over the paged KV cache, one per side of the kernels, chosen with the model's ops.

Every backend has `plan(metadata)`, the tensors built once per step and shared by every layer, and
`forward(q, k, v, kv_cache, plan, scale)`, which writes the new tokens' keys and values into the cache
and returns the attention output [T, heads, head_dim]:

- TorchPagedAttention: the plain-torch reference (`kernels/paged_attention.py`); runs anywhere and
  defines what the others compute.
- CpuPagedAttention: the reference, with decode steps (float32, bfloat16 or float16) on the C++ kernel
  (`kernels/cpu_decode_attention.py`), which reads cached blocks in place instead of gathering them.
- OpaquePagedAttention: CpuPagedAttention behind one custom op, so `torch.compile` neither traces nor
  breaks on it (compiled CPU artifacts).
- TritonPagedAttention: the Triton decode and prefill kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import cpu_decode_attention as cpu_kernel
from kernels.decode_attention import paged_decode_attention
from kernels.kv_cache import write_kv_cache, write_kv_cache_ref
from kernels.ops import Ops
from kernels.paged_attention import GatherPlan, gathered_attention, plan_gather
from kernels.prefill_attention import paged_prefill_attention
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


class TorchPagedAttention:
    """The reference attention: plain torch, runs anywhere, defines what the kernels must compute."""

    def __init__(self, block_size: int, sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window

    def plan(self, meta: AttentionMetadata) -> TorchAttentionPlan:
        gather = plan_gather(meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.max_query_len,
                             meta.max_seq_len, self.block_size, self.sliding_window)
        return TorchAttentionPlan(*gather, slot_mapping=meta.slot_mapping, seq_lens=meta.seq_lens)

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        plan: TorchAttentionPlan,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        write_kv_cache_ref(k, v, kv_cache, plan.slot_mapping)
        return gathered_attention(q, kv_cache, plan.gather, scale)


class CpuPagedAttention(TorchPagedAttention):
    """The reference, with decode steps on the C++ kernel (any of its cache dtypes; it computes in float32)."""

    def forward(self, q, k, v, kv_cache, plan: TorchAttentionPlan, scale: float) -> torch.Tensor:
        if (plan.is_decode and kv_cache.dtype in cpu_kernel.CACHE_DTYPES and q.dtype == kv_cache.dtype
                and cpu_kernel.load()):
            write_kv_cache_ref(k, v, kv_cache, plan.slot_mapping)
            return cpu_kernel.paged_decode_attention(q, kv_cache, plan.block_tables, plan.seq_lens, scale,
                                                     self.sliding_window)
        return super().forward(q, k, v, kv_cache, plan, scale)


@torch.library.custom_op("ladder::paged_attention", mutates_args=("kv_cache",))
def paged_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
    query_index: torch.Tensor, output_index: torch.Tensor, block_tables: torch.Tensor, mask: torch.Tensor,
    slot_mapping: torch.Tensor, seq_lens: torch.Tensor, scale: float, block_size: int, sliding_window: int,
) -> torch.Tensor:
    """CpuPagedAttention.forward with the plan spelled out as tensors (custom ops take no dataclasses)."""
    plan = TorchAttentionPlan(query_index, output_index, block_tables, mask, slot_mapping, seq_lens)
    return CpuPagedAttention(block_size, sliding_window or None).forward(q, k, v, kv_cache, plan, scale)


@paged_attention_op.register_fake
def _(q, k, v, kv_cache, *rest) -> torch.Tensor:
    return torch.empty_like(q)


class OpaquePagedAttention(TorchPagedAttention):
    """The CPU attention behind one custom op, so `torch.compile` neither traces nor breaks on it."""

    def forward(self, q, k, v, kv_cache, plan: TorchAttentionPlan, scale: float) -> torch.Tensor:
        return paged_attention_op(q, k, v, kv_cache, plan.query_index, plan.output_index, plan.block_tables,
                                  plan.mask, plan.slot_mapping, plan.seq_lens, scale, self.block_size,
                                  self.sliding_window or 0)


class TritonPagedAttention:
    """Attention on the Triton kernels; its plan is the metadata itself (the kernels read it directly)."""

    def __init__(self, block_size: int, sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window

    def plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        return meta

    def forward(self, q, k, v, kv_cache, plan: AttentionMetadata, scale: float) -> torch.Tensor:
        if kv_cache.shape[2] != self.block_size:
            raise ValueError(f"kv_cache block size {kv_cache.shape[2]} differs from the model's {self.block_size}")
        write_kv_cache(k, v, kv_cache, plan.slot_mapping)
        if plan.max_query_len == 1:  # every sequence brings one token: pure decode
            return paged_decode_attention(q, kv_cache, plan.seq_lens, plan.block_tables, plan.max_seq_len, scale,
                                          self.sliding_window)
        return paged_prefill_attention(q, kv_cache, plan.query_start_loc, plan.seq_lens, plan.block_tables,
                                       plan.max_query_len, scale, self.sliding_window)


AttentionBackend = TorchPagedAttention | TritonPagedAttention
AttentionPlan = TorchAttentionPlan | AttentionMetadata  # what a backend's plan() returns
BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchPagedAttention, "cpu": CpuPagedAttention, "triton": TritonPagedAttention,
}


def attention_for(ops: Ops, block_size: int, sliding_window: int | None) -> AttentionBackend:
    """The backend that goes with a model's ops (kernels/ops.py names the side)."""
    return BACKENDS[ops.name](block_size, sliding_window)
