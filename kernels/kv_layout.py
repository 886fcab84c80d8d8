"""The paged KV cache's layout, in plain Python (no torch), so block bookkeeping can share it.

A layer's cache is [2, num_blocks, block_size, num_kv_heads, head_dim]: keys, then values. Slot s is row
s % block_size of block s // block_size. These two functions are the one place the shape and the block
arithmetic are spelled out.
"""

from __future__ import annotations


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """How many blocks of `block_size` slots hold `num_tokens` tokens (the ceiling of the quotient)."""
    return -(-num_tokens // block_size)


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """The shape of one layer's cache: keys then values, each [num_blocks, block_size, kv_heads, head_dim]."""
    return (2, num_blocks, block_size, num_kv_heads, head_dim)
