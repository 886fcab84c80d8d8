"""Token-by-token generation of one sequence over the paged cache.

One sequence on the `Sequences` driver: the whole prompt prefilled in one step, then one token per
step. `ladder generate` and the parity tests use it; the continuous-batching engine drives the same
step interface for many sequences.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from model.sequences import Sequences
from model.step import InputEmbeds, StepModel
from model.vision import EncodedImages, Vision


@dataclass(frozen=True)
class GenerationStep:
    token_id: int
    logits: torch.Tensor  # [vocab] float32 logits the token was chosen from


class Generator:
    def __init__(self, module: StepModel, max_len: int) -> None:
        """Reserve a cache for one sequence of up to `max_len` tokens (prompt plus output)."""
        self.max_len = max_len
        self.device = module.device
        if callable(getattr(module, "fit_rotary_to", None)):
            module.fit_rotary_to(max_len)  # LongRoPE's factors for this context
        self.sequence = Sequences(module, 1, max_len)

    def step(self, new_tokens: list[int], embeds: InputEmbeds | None = None) -> torch.Tensor:
        """Append `new_tokens` to the sequence; returns the logits of every new token [N, vocab]."""
        return self.sequence.step([new_tokens], all_rows=True, embeds=[embeds])

    def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        stop_token_ids: frozenset[int] = frozenset(),
        images: EncodedImages | None = None,
        vision: Vision | None = None,
    ) -> Iterator[GenerationStep]:
        """Yield up to `max_tokens` tokens; stops after (and including) a stop token. `images`: the embeddings
        of the prompt's image tokens (`vision`'s), in order (model/vision.py)."""
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) + max_tokens > self.max_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds {self.max_len}"
            )
        rng = torch.Generator(device=self.device)
        rng.manual_seed(seed if seed is not None else torch.seed())
        embeds = None
        if images is not None:
            if vision is None:
                raise ValueError("images need the model's vision")
            rows = [i for i, t in enumerate(prompt) if t == vision.image_token_id]
            if len(rows) != images.embeds.shape[0]:
                raise ValueError(f"the prompt has {len(rows)} image tokens and its images {images.embeds.shape[0]} "
                                 "embeddings")
            embeds = InputEmbeds(torch.tensor(rows, dtype=torch.long), images.embeds, vision.bidirectional)
        logits = self.step(prompt, embeds)[-1]
        for i in range(max_tokens):
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=rng))
            else:
                token = int(torch.argmax(logits))
            yield GenerationStep(token, logits)
            if token in stop_token_ids or i == max_tokens - 1:
                return
            logits = self.step([token])[-1]
