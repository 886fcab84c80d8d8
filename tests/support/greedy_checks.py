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


def count_near_ties(reference: list[tuple[list[int], list]], got: list[list[int]], num_tokens: int) -> int:
    """Each run's tokens against its reference run's (tokens, per-token logprobs with `.top`, best first);
    a divergence is allowed only where the reference's best two logprobs are within 1e-3, and ends that
    run's comparison. Returns how many runs diverged so."""
    ties = 0
    for i, ((ref_tokens, ref_logprobs), tokens) in enumerate(zip(reference, got, strict=True)):
        assert len(tokens) == len(ref_tokens) == num_tokens
        for step, (a, b) in enumerate(zip(tokens, ref_tokens)):
            if a != b:
                top = ref_logprobs[step].top
                gap = top[0][1] - top[1][1]
                assert gap < 1e-3, f"prompt {i} diverges at token {step} with a gap of {gap:.2e}"
                ties += 1
                print(f"near tie: prompt {i}, token {step}, gap {gap:.1e}")
                break
    return ties
