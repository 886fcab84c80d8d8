"""The interface every attention backend implements over the paged KV cache.

A step's attention runs in two parts. `plan(meta)` builds, once per step, what every layer shares (the
backend's own tensors: index maps, padded block tables, or the metadata itself). `forward(q, k, v,
kv_cache, plan, scale)` then runs per layer: it writes the step's new keys and values into the layer's
cache at `plan`'s slots and returns the attention of the new tokens' queries over each sequence's cached
context. A backend holds no per-step state, so one instance serves every layer of a model
(`model.attention.install` gives it to them).

Shapes (T new tokens of S sequences laid end to end; see model/attention_metadata.py):
    q         [T, num_heads, head_dim]
    k, v      [T, num_kv_heads, head_dim]
    kv_cache  [2, num_blocks, block_size, num_kv_heads, head_dim] (keys, then values), written in place
    sinks     [num_heads] float32 or None: each query head's sink logit (GPT-OSS; see kernels/paged_attention.py),
              taken by the torch and CPU backends; the others refuse it (`refuse_sinks`)
    returns   [T, num_heads, head_dim], in q's dtype
Backends that only trace or export (see export_backend.py) may return the new cache instead of writing
it; what they do is theirs to document.
"""

from __future__ import annotations

from typing import Any

import torch

from model.attention_metadata import AttentionMetadata


class BaseAttention:
    """`block_size`: tokens per KV block; `sliding_window`: the keys a query may see, counted back from
    its own position (None: the whole context)."""

    def __init__(self, block_size: int, sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window

    def plan(self, meta: AttentionMetadata) -> Any:
        """The step's shared attention inputs, built once and passed to every layer's `forward`."""
        raise NotImplementedError

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        plan: Any,  # what this backend's plan() returned for the step
        scale: float,  # applied to q @ k^T before the softmax
        sinks: torch.Tensor | None = None,  # [num_heads]
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        raise NotImplementedError


def refuse_sinks(backend: BaseAttention, sinks: torch.Tensor | None) -> None:
    """ValueError from a backend whose kernels have no sink logits, when given some."""
    if sinks is not None:
        raise ValueError(f"{type(backend).__name__} has no attention sinks (GPT-OSS): the eager torch and CPU "
                         "backends have them")
