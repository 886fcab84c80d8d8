"""A few sequences on a private paged cache: the smallest driver of a `StepModel`.

Each sequence owns its own run of blocks, so no block manager or scheduler is needed. Generation
(`model/generator.py`), the compile pipeline's parity report and decode benchmark, and the warm-up of
compiled artifacts drive models through it.
"""

from __future__ import annotations

import torch

from kernels.kv_layout import blocks_for_tokens
from model.step import InputEmbeds, SeqChunk, StepModel, allocate_caches, build_step, keeps_states, run_step


class Sequences:
    def __init__(self, model: StepModel, num_seqs: int, max_len: int) -> None:
        """Reserve room for `num_seqs` sequences of up to `max_len` tokens each."""
        self.model = model
        self.max_len = max_len
        blocks_per_seq = blocks_for_tokens(max_len, model.block_size)
        # A model whose cache is split into pools (tensor parallelism by sequences) needs each sequence's
        # blocks in one pool: sequence i goes to pool i % pools.
        pools = model.kv_pools
        per_pool = -(-num_seqs // pools) * blocks_per_seq
        self.kv_caches = allocate_caches(model, pools * per_pool, num_seqs)
        self.keeps_states = keeps_states(model)  # then sequence s keeps its state in slot s
        self.tables = [list(range(start, start + blocks_per_seq))
                       for i in range(num_seqs) for start in [i % pools * per_pool + i // pools * blocks_per_seq]]
        self.lengths = [0] * num_seqs

    def step(self, new_tokens: list[list[int]], all_rows: bool = False,
             embeds: list[InputEmbeds | None] | None = None) -> torch.Tensor:
        """Append new_tokens[s] to sequence s (empty: skip it); logits [rows, vocab] float32 of each
        sequence's last token, or of every new token with all_rows. `embeds[s]`: rows of sequence s's new
        tokens that run on these embeddings (an image's)."""
        chunks = []
        for s, tokens in enumerate(new_tokens):
            if self.lengths[s] + len(tokens) > self.max_len:
                raise ValueError(f"sequence of {self.lengths[s] + len(tokens)} tokens exceeds the reserved "
                                 f"{self.max_len}")
            chunks.append(SeqChunk(tokens, self.lengths[s], self.tables[s], len(tokens) if all_rows else 1,
                                   embeds=embeds[s] if embeds is not None else None,
                                   state_slot=s if self.keeps_states else -1))
            self.lengths[s] += len(tokens)
        inputs = build_step(chunks, self.model.block_size, self.model.device)
        return run_step(self.model, inputs, self.kv_caches).float()
