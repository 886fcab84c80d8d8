"""Perplexity on a built-in English text: the quality measure of every precision change.

The text is the English help topics that ship with Python (`pydoc_data.topics`), so it is on every
machine. The parity report measures perplexity on its first 2,048 tokens; SmoothQuant calibrates on
tokens past that slice, so the two never overlap.
"""

from __future__ import annotations

import math

import torch

from model.sequences import Sequences
from model.step import StepModel

PERPLEXITY_TOKENS = 2048
CHUNK = 256


def corpus_text() -> str:
    """The built-in text: the English help topics that ship with Python (`pydoc_data.topics`)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def token_nll(model: StepModel, token_ids: list[int]) -> torch.Tensor:
    """Negative log-likelihood [len-1] of each token given the ones before, in chunks of CHUNK tokens
    (chunked prefill: each chunk attends to the cached ones before it)."""
    seqs = Sequences(model, 1, len(token_ids))
    losses = []
    for start in range(0, len(token_ids) - 1, CHUNK):
        chunk = token_ids[start:start + CHUNK]
        logits = seqs.step([chunk], all_rows=True)
        targets = torch.tensor(token_ids[start + 1:start + 1 + len(chunk)])
        logits = logits[: len(targets)]
        losses.append(torch.nn.functional.cross_entropy(logits, targets.to(logits.device), reduction="none").cpu())
    return torch.cat(losses)


def perplexity(model: StepModel, token_ids: list[int]) -> float:
    return math.exp(token_nll(model, token_ids).mean().item())
