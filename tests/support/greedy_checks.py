"""Greedy decoding compared with a reference's tokens, allowing a divergence only at a near tie."""

from __future__ import annotations

import torch

NUM_GREEDY = 32


def assert_same_greedy(ours: list[int], ref_tokens: list[int], ref_logits: list[torch.Tensor]) -> None:
    """Same tokens, except that a divergence at a near tie (reference's best two logits within 1e-3)
    is accepted and ends the comparison."""
    for i, (a, b) in enumerate(zip(ours, ref_tokens)):
        if a != b:
            top2 = ref_logits[i].topk(2).values
            assert (top2[0] - top2[1]).item() < 1e-3, f"greedy token {i} differs: {a} vs {b} (no near tie)"
            return
    assert len(ours) == len(ref_tokens)
