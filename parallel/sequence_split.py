"""Attention split by sequences: each rank runs q/k/v, attention and o_proj, with every head, for its own
sequences; the MLP stays split by columns across all the batch's tokens.

Splitting attention by heads (parallel/shard.py) leaves a rank idle when the heads do not divide evenly
(the default model's 3 KV heads over 2 ranks: 1 and 2), and under W8A8 o_proj runs whole on every rank.
Split by sequences, each rank's attention work follows the sequences it holds, o_proj's rows are split
with them, and one all-gather of o_proj's output rows takes the place of the heads' all-gather. The cost:
q/k/v and o_proj weights are whole on every rank, and a sequence's KV cache lives on one rank only.

Which rank holds a sequence follows from its blocks: the engine's block manager splits the cache into
one pool per rank (engine/block_manager.py) and gives each sequence blocks of one pool, so rank r keeps
only pool r's blocks (global id - r * pool_size) and a sequence belongs to the pool of its first block.
Both ranks derive the split from the same broadcast metadata, so no extra message is needed.

Each row of q/k/v and o_proj sees the same arithmetic as in one process (their activation scales are
per token), so W8A8 stays bit-exact with one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from model.attention_metadata import AttentionMetadata
from parallel.collectives import Collectives
from parallel.layout import TensorParallelLayout


@dataclass(frozen=True)
class SequencePlan:
    """What every layer's attention needs to run this rank's sequences and put the batch back together."""

    rows: slice | torch.Tensor  # this rank's token rows of the flat batch: a run of them (the engine's
    # batches go pool by pool), or [T_rank] indices
    counts: list[int]  # tokens each rank holds this step, in rank order
    order: torch.Tensor | None  # [T] row i of the batch is row order[i] of the ranks' concatenation; None: same
    local: Any | None  # the attention backend's plan of this rank's sequences; None: it holds none


def local_metadata(meta: AttentionMetadata, rank: int, size: int, pool_size: int,
                   block_size: int) -> tuple[AttentionMetadata | None, torch.Tensor, list[int]]:
    """(rank's metadata with its own block ids or None, each token's rank [T], tokens per rank)."""
    tables = meta.block_tables.cpu()
    owner = torch.div(tables[:, 0], pool_size, rounding_mode="floor")  # [S] a sequence's first block's pool
    starts = meta.query_start_loc.cpu()
    query_lens = starts[1:] - starts[:-1]  # [S]
    token_owner = owner.repeat_interleave(query_lens)  # [T]
    counts = torch.bincount(token_owner, minlength=size).tolist()
    mine = (owner == rank).nonzero().squeeze(1)
    if mine.numel() == 0:
        return None, token_owner, counts
    local_lens = query_lens[mine]
    seq_lens = meta.seq_lens.cpu()[mine]
    first = rank * pool_size
    # Padding entries of a table may hold any valid id (they are masked): keep them inside the pool.
    local_tables = (tables[mine] - first).clamp_(0, pool_size - 1)
    slots = meta.slot_mapping.cpu()[token_owner == rank] - first * block_size
    local = AttentionMetadata(
        query_start_loc=torch.cat([local_lens.new_zeros(1), local_lens.cumsum(0)]),
        seq_lens=seq_lens, block_tables=local_tables, slot_mapping=slots,
        max_query_len=int(local_lens.max()), max_seq_len=int(seq_lens.max()))
    device = meta.seq_lens.device
    if device.type != "cpu":
        local = AttentionMetadata(*(t.to(device) for t in (local.query_start_loc, local.seq_lens, local.block_tables,
                                                           local.slot_mapping)), local.max_query_len, local.max_seq_len)
    return local, token_owner, counts


def plan_sequences(attention, meta: AttentionMetadata, rank: int, size: int, pool_size: int,
                   block_size: int) -> SequencePlan:
    """The rank's SequencePlan for a step (`attention`: the model's backend, which plans its own part)."""
    local, token_owner, counts = local_metadata(meta, rank, size, pool_size, block_size)
    device = meta.seq_lens.device
    if bool((token_owner[1:] >= token_owner[:-1]).all()):  # rank-major already: views, no reordering
        start = sum(counts[:rank])
        return SequencePlan(slice(start, start + counts[rank]), counts, None,
                            None if local is None else attention.plan(local))
    rows = (token_owner == rank).nonzero().squeeze(1).to(device)
    by_rank = torch.argsort(token_owner, stable=True)  # [T] the concatenation's rows, as batch rows
    order = torch.empty_like(by_rank)
    order[by_rank] = torch.arange(by_rank.numel())
    return SequencePlan(rows, counts, order.to(device), None if local is None else attention.plan(local))


class SequenceSplitAttention(nn.Module):
    """A decoder layer's attention over this rank's sequences, its output rows all-gathered into the batch."""

    def __init__(self, attention: nn.Module, collectives: Collectives) -> None:
        super().__init__()
        self.attention = attention  # the model's own Attention, whole (every head)
        self.collectives = collectives

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                plan: SequencePlan) -> torch.Tensor:  # x [T, hidden] -> [T, hidden]
        x, cos, sin = x[plan.rows], cos[plan.rows], sin[plan.rows]  # views when rows is a slice
        if plan.local is None:
            out = x.new_empty(0, self.attention.o_proj.out_features)
        else:
            out = self.attention(x, cos, sin, kv_cache, plan.local)
        gathered = self.collectives.all_gather_rows(out.contiguous(), plan.counts)
        return gathered if plan.order is None else gathered[plan.order]


def rank_plan(shard: nn.Module, layout: TensorParallelLayout, meta: AttentionMetadata, rank: int,
              blocks_per_rank: int) -> Any:
    """The plan rank `rank`'s shard runs a step with, split by heads or by sequences (every rank derives
    its own from the same broadcast metadata)."""
    if layout.by_sequences:
        return plan_sequences(shard.attention, meta, rank, layout.size, blocks_per_rank, shard.block_size)
    return shard.plan(meta)
