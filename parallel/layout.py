"""Which part of each weight a rank holds: contiguous ranges of KV heads, MLP columns and vocabulary.

KV heads are the unit of the attention split: a rank holds whole KV heads and the query heads that
read them, so attention needs no communication. A size that does not divide the KV heads is served
with an uneven split (SmolLM2-135M, the default model, has 3 KV heads and 9 query heads: at size 2 one
rank holds 1 KV head, the other 2); the remainder goes to the last ranks, since rank 0 also schedules
and samples. A size above the number of KV heads would leave a rank without attention work and is
refused.

Experts (mixture-of-experts layers) are split whole: rank r holds a contiguous E / size of them, and a
size that does not divide E is refused (an uneven split would leave the ranks unequal work per token).

Split by sequences instead (parallel/sequence_split.py), every rank holds every head, and the KV cache
is split by blocks: rank r holds pool r of the engine's blocks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from model.config import ModelConfig

ATTENTION_SPLITS = ("heads", "sequences")


def split(total: int, size: int) -> list[range]:
    """`total` units in `size` contiguous ranges whose lengths differ by at most one, longer ones last."""
    base, extra = divmod(total, size)
    lengths = [base + (1 if rank >= size - extra else 0) for rank in range(size)]
    starts = [sum(lengths[:rank]) for rank in range(size)]
    return [range(start, start + length) for start, length in zip(starts, lengths)]


@dataclass(frozen=True)
class TensorParallelLayout:
    size: int
    kv_heads: list[range]  # per rank
    intermediate: list[range]  # per rank, columns of gate and of up (rows of down's input)
    vocab: list[range]  # per rank, rows of the embedding and of the LM head
    heads_per_kv: int  # query heads per KV head (GQA group)
    head_dim: int
    by_sequences: bool = False  # attention split by sequences: every rank holds every head
    experts: tuple[range, ...] = ()  # per rank, the experts of each sparse layer it holds; () for a dense model

    @classmethod
    def for_model(cls, config: ModelConfig, size: int, attention: str = "heads") -> TensorParallelLayout:
        """ValueError (one line) for a size the model cannot be split into. `attention`: split by
        "heads" or by "sequences"."""
        if size < 1:
            raise ValueError(f"--tensor-parallel-size must be at least 1, got {size}")
        if attention not in ATTENTION_SPLITS:
            raise ValueError(f"attention is split by one of {', '.join(ATTENTION_SPLITS)}, not {attention!r}")
        if size > 1:
            config.require_alike_layers("--tensor-parallel-size above 1")
        if config.num_experts % size:
            raise ValueError(f"--tensor-parallel-size {size} does not divide the model's {config.num_experts} "
                             "experts: each rank must hold the same number of whole experts")
        experts = tuple(split(config.num_experts, size)) if config.num_experts else ()
        if attention == "sequences":
            return cls(size, [range(config.num_kv_heads)] * size, split(config.intermediate_size, size),
                       split(config.vocab_size, size), config.num_heads // config.num_kv_heads, config.head_dim,
                       by_sequences=True, experts=experts)
        if size > config.num_kv_heads:
            raise ValueError(f"--tensor-parallel-size {size} exceeds the model's {config.num_kv_heads} KV heads "
                             f"({config.num_heads} query heads): each rank must hold at least one KV head")
        return cls(size, split(config.num_kv_heads, size), split(config.intermediate_size, size),
                   split(config.vocab_size, size), config.num_heads // config.num_kv_heads, config.head_dim,
                   experts=experts)

    def q_heads(self, rank: int) -> range:
        kv = self.kv_heads[rank]
        return range(kv.start * self.heads_per_kv, kv.stop * self.heads_per_kv)

    def q_rows(self, rank: int) -> range:
        """Rows of the query projection (and columns of o_proj) the rank holds."""
        heads = self.q_heads(rank)
        return range(heads.start * self.head_dim, heads.stop * self.head_dim)

    def kv_rows(self, rank: int) -> range:
        kv = self.kv_heads[rank]
        return range(kv.start * self.head_dim, kv.stop * self.head_dim)

    def local_config(self, config: ModelConfig, rank: int) -> ModelConfig:
        """The model as rank `rank` sees its attention: its own heads (the size of its KV cache)."""
        num_kv = len(self.kv_heads[rank])
        return dataclasses.replace(config, num_kv_heads=num_kv, num_heads=num_kv * self.heads_per_kv)

    def blocks_per_rank(self, num_blocks: int) -> int:
        """KV blocks a rank allocates when the engine has `num_blocks` (its pool, split by sequences)."""
        return num_blocks // self.size if self.by_sequences else num_blocks

    @property
    def kv_pools(self) -> int:
        """Pools the engine's block manager keeps: one per rank when split by sequences."""
        return self.size if self.by_sequences else 1

    @property
    def is_even(self) -> bool:
        return len({len(r) for r in self.kv_heads}) == 1
