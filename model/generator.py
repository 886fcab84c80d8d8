"""Token-by-token generation of one sequence over the paged cache.

This is the smallest driver of the model's flat-batch `forward`: one sequence, blocks allocated in
order, the whole prompt prefilled in one step, then one token per step. `ladder generate` and the
parity tests use it; the continuous-batching engine drives the same `forward` for many sequences.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from model.attention import AttentionMetadata
from model.llama import LlamaForCausalLM


@dataclass(frozen=True)
class GenerationStep:
    token_id: int
    logits: torch.Tensor  # [vocab] float32 logits the token was chosen from


class Generator:
    def __init__(self, module: LlamaForCausalLM, max_len: int) -> None:
        """Reserve a cache for one sequence of up to `max_len` tokens (prompt plus output)."""
        self.module = module
        self.block_size = module.block_size
        self.max_len = max_len
        num_blocks = -(-max_len // self.block_size)
        self.block_table = list(range(num_blocks))
        self.kv_caches = module.allocate_kv_caches(num_blocks)
        self.device = module.embed_tokens.weight.device

    @torch.inference_mode()
    def step(self, new_tokens: list[int], num_cached: int) -> torch.Tensor:
        """Run `new_tokens` after `num_cached` cached ones; returns logits of every new token [N, vocab]."""
        total = num_cached + len(new_tokens)
        if total > self.max_len:
            raise ValueError(f"sequence of {total} tokens exceeds the reserved {self.max_len}")
        meta = AttentionMetadata.build([len(new_tokens)], [total], [self.block_table], self.block_size, self.device)
        input_ids = torch.tensor(new_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_cached, total, device=self.device)
        hidden = self.module(input_ids, positions, self.kv_caches, meta)
        return self.module.compute_logits(hidden)

    def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        stop_token_ids: frozenset[int] = frozenset(),
    ) -> Iterator[GenerationStep]:
        """Yield up to `max_tokens` tokens; stops after (and including) a stop token."""
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) + max_tokens > self.max_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds {self.max_len}"
            )
        rng = torch.Generator(device=self.device)
        rng.manual_seed(seed if seed is not None else torch.seed())
        logits = self.step(prompt, 0)[-1]
        num_cached = len(prompt)
        for i in range(max_tokens):
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=rng))
            else:
                token = int(torch.argmax(logits))
            yield GenerationStep(token, logits)
            if token in stop_token_ids or i == max_tokens - 1:
                return
            logits = self.step([token], num_cached)[-1]
            num_cached += 1
