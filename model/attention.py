"""Attention over a paged KV cache: the metadata that describes a flat batch, and the plain-torch path.

A step's batch is flat: the T new tokens of S sequences are laid end to end (`input_ids[T]`), each
sequence's tokens contiguous and in order. Each sequence may bring one token (decode), a chunk of its
prompt (prefill), or anything in between; the metadata below is all attention needs to tell them apart.

The KV cache of one layer is a tensor `[2, num_blocks, block_size, num_kv_heads, head_dim]` (keys, then
values). A sequence owns a list of blocks (its row of `block_tables`); token p of the sequence lives at
slot `block_tables[s, p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu_decode_attention as kernel


@dataclass(frozen=True)
class AttentionMetadata:
    """Where the flat batch's tokens sit, per sequence and in the paged cache.

    query_start_loc: [S + 1] int64, cumulative new-token counts (sequence s owns rows
        query_start_loc[s]:query_start_loc[s+1] of the flat batch).
    seq_lens: [S] int64, tokens in the cache for each sequence once this step's are written
        (cached context + new tokens). New token i of sequence s is at position
        seq_lens[s] - num_new[s] + i.
    block_tables: [S, max_blocks] int64, block ids of each sequence; unused entries may hold any
        valid block id (they are masked out).
    slot_mapping: [T] int64, cache slot where each new token's key and value are written.
    max_query_len, max_seq_len: Python ints, so shapes are known without a device sync.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata from plain lists: the runner's (and the tests') way in."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            if not 0 < q_len <= s_len:
                raise ValueError(f"query length {q_len} must be in [1, seq_len={s_len}]")
            if len(table) * block_size < s_len:
                raise ValueError(f"{len(table)} blocks of {block_size} cannot hold {s_len} tokens")
            for pos in range(s_len - q_len, s_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max(len(t) for t in block_tables)
        padded = [t + [t[0]] * (width - len(t)) for t in block_tables]
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        as_long = dict(dtype=torch.long, device=device)
        return cls(
            query_start_loc=torch.tensor(starts, **as_long),
            seq_lens=torch.tensor(seq_lens, **as_long),
            block_tables=torch.tensor(padded, **as_long),
            slot_mapping=torch.tensor(slots, **as_long),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )


@dataclass(frozen=True)
class TorchAttentionPlan:
    """Index tensors shared by every layer of one forward pass (built once per step, not per layer).

    The flat queries are scattered into a padded [S, max_q] grid so one batched SDPA call serves
    prefill chunks and decodes together; padding costs little at the batch sizes a CPU runs.
    """

    query_index: torch.Tensor  # [S, max_q] flat row of each padded query (0 where padding)
    output_index: torch.Tensor  # [T] where each flat row sits in the padded grid flattened to [S * max_q]
    block_tables: torch.Tensor  # [S, num_blocks] only the blocks the longest sequence needs
    mask: torch.Tensor  # [S, 1, max_q, num_blocks * block_size] bool, True = may attend
    slot_mapping: torch.Tensor  # [T]
    seq_lens: torch.Tensor  # [S]

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
        device = meta.seq_lens.device
        query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]  # [S]
        rows = torch.arange(meta.max_query_len, device=device)  # [max_q]
        query_valid = rows[None, :] < query_lens[:, None]
        query_index = torch.where(query_valid, meta.query_start_loc[:-1, None] + rows[None, :], 0)
        num_blocks = -(-meta.max_seq_len // self.block_size)
        keys = torch.arange(num_blocks * self.block_size, device=device)  # [L]
        # Absolute position of each padded query; causality then also hides slots past seq_len.
        query_pos = (meta.seq_lens - query_lens)[:, None] + rows[None, :]  # [S, max_q]
        mask = keys[None, None, :] <= query_pos[:, :, None]
        if self.sliding_window is not None:
            mask &= keys[None, None, :] > query_pos[:, :, None] - self.sliding_window
        # An index, not a boolean mask, so the output's shape [T] is known without reading the data
        # (exporters and compilers need that).
        output_index = torch.nonzero(query_valid.flatten()).squeeze(1)
        return TorchAttentionPlan(
            query_index=query_index,
            output_index=output_index,
            block_tables=meta.block_tables[:, :num_blocks].contiguous(),
            mask=mask[:, None],
            slot_mapping=meta.slot_mapping,
            seq_lens=meta.seq_lens,
        )

    @staticmethod
    def write_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store the new tokens' keys and values [T, kv_heads, head_dim] at their slots."""
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        plan: TorchAttentionPlan,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        self.write_cache(k, v, kv_cache, plan.slot_mapping)
        num_seqs = plan.block_tables.shape[0]
        # [S, num_blocks, block_size, kvh, d] -> [S, kvh, L, d]
        keys = key_cache[plan.block_tables].reshape(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
        values = value_cache[plan.block_tables].reshape(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
        queries = q[plan.query_index].transpose(1, 2)  # [S, H, max_q, d]
        out = F.scaled_dot_product_attention(
            queries, keys.to(q.dtype), values.to(q.dtype), attn_mask=plan.mask, scale=scale,
            enable_gqa=num_kv_heads != q.shape[1],
        )
        out = out.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])  # [S * max_q, H, d]
        return out[plan.output_index]  # [T, H, d]


class CpuPagedAttention(TorchPagedAttention):
    """The torch attention, with float32 decode steps on the C++ kernel of
    `kernels/cpu_decode_attention.py`, which reads cached blocks in place instead of gathering them."""

    def forward(self, q, k, v, kv_cache, plan: TorchAttentionPlan, scale: float) -> torch.Tensor:
        if plan.is_decode and q.dtype == torch.float32 and kv_cache.dtype == torch.float32 and kernel.load():
            self.write_cache(k, v, kv_cache, plan.slot_mapping)
            return kernel.paged_decode_attention(q, kv_cache, plan.block_tables, plan.seq_lens, scale,
                                                 self.sliding_window)
        return super().forward(q, k, v, kv_cache, plan, scale)
