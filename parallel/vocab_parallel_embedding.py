"""The embedding table split by vocabulary rows: each rank looks up the ids it holds, zeros elsewhere,
and an all-reduce sums the ranks' rows into the full embedding on every rank."""

from __future__ import annotations

import torch
from torch import nn

from parallel.collectives import Collectives


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, vocab: range, collectives: Collectives) -> None:
        """`weight`: [len(vocab), hidden], the rows of token ids `vocab`."""
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # the name the full table has
        self.vocab_start, self.num_local = vocab.start, len(vocab)
        self.collectives = collectives

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, hidden]
        local = input_ids - self.vocab_start
        elsewhere = (local < 0) | (local >= self.num_local)
        out = nn.functional.embedding(local.masked_fill(elsewhere, 0), self.weight)
        out.masked_fill_(elsewhere.unsqueeze(-1), 0.0)
        return self.collectives.all_reduce(out)
