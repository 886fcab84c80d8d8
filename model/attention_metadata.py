"""Where a flat batch's tokens sit, per sequence and in the paged KV cache.

A step's batch is flat: the T new tokens of S sequences are laid end to end (`input_ids[T]`), each
sequence's tokens contiguous and in order. Each sequence may bring one token (decode), a chunk of its
prompt (prefill), or anything in between; the metadata below is all attention needs to tell them apart.

The KV cache of one layer is a tensor `[2, num_blocks, block_size, num_kv_heads, head_dim]` (keys, then
values; `kernels.kv_layout.kv_cache_shape`). A sequence owns a list of blocks (its row of `block_tables`);
token p of the sequence lives at slot `block_tables[s, p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.kv_layout import blocks_for_tokens


@dataclass(frozen=True)
class AttentionMetadata:
    """query_start_loc: [S + 1] int64, cumulative new-token counts (sequence s owns rows
        query_start_loc[s]:query_start_loc[s+1] of the flat batch).
    seq_lens: [S] int64, tokens in the cache for each sequence once this step's are written
        (cached context + new tokens). New token i of sequence s is at position
        seq_lens[s] - num_new[s] + i.
    block_tables: [S, max_blocks] int64, block ids of each sequence; unused entries may hold any
        valid block id (they are masked out).
    slot_mapping: [T] int64, cache slot where each new token's key and value are written.
    max_query_len, max_seq_len: Python ints, so shapes are known without a device sync.
    window: the same step in the sliding-window layers' own cache, when they have one
        (engine/window_blocks.py): other block tables and slots, the same tokens; None: they share these.
    key_ends: [T] int64 or None, the keys (positions 0 .. key_ends[t] - 1) each new token sees where some
        token sees past its own position: an image's tokens see the whole image (Gemma 3). A sliding window
        still counts back from the token's own position. None: every token is causal (position + 1).
    state_slots: [S] int64 or None, each sequence's row of the linear-attention layers' state pools
        (model/linear_attention.py); None for a model without such layers.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    window: AttentionMetadata | None = None
    key_ends: torch.Tensor | None = None
    state_slots: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata from plain lists (the step driver's, and the tests', way in)."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            if not 0 < q_len <= s_len:
                raise ValueError(f"query length {q_len} must be in [1, seq_len={s_len}]")
            if len(table) < blocks_for_tokens(s_len, block_size):
                raise ValueError(f"{len(table)} blocks of {block_size} cannot hold {s_len} tokens")
            for pos in range(s_len - q_len, s_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        # At least two columns: with one, a table's row stride is 1, which torch.compile specializes on
        # (sizes and strides of 0 and 1 are special cases), compiling a second graph for short batches.
        width = max(2, *(len(t) for t in block_tables))
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
