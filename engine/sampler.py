"""Choosing the next token of every sequence in one batched call.

Logits [B, V] go through penalties, temperature, top-k, top-p and min-p as tensor ops over per-row
parameters. Each row then draws one uniform number (from the request's own generator when it has a
seed, so a seeded request samples the same tokens whatever else is in the batch) and picks the token
where that number falls in its cumulative distribution. Greedy rows take the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request, TokenLogprobs


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)  # for requests without a seed
        self.request_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self.request_generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits [B, V] float32, one row per request, in order."""
        raw_logits = logits
        logits = logits.clone()
        device = logits.device
        params = [r.params for r in requests]
        self._suppress_stop_tokens(logits, requests)
        if any(p.has_penalties for p in params):
            apply_penalties(logits, requests)
        temperature = torch.tensor([1.0 if p.is_greedy else p.temperature for p in params], device=device)
        logits.div_(temperature[:, None])
        top_k = [p.top_k for p in params]
        if any(top_k):
            vocab = logits.shape[1]
            logits = apply_top_k(logits, torch.tensor([min(k, vocab) or vocab for k in top_k], device=device))
        probs = torch.softmax(logits, dim=-1)
        top_p = [p.top_p for p in params]
        if any(p < 1.0 for p in top_p):
            probs = apply_top_p(probs, torch.tensor(top_p, device=device))
        min_p = [p.min_p for p in params]
        if any(min_p):
            probs = apply_min_p(probs, torch.tensor(min_p, device=device))
        uniform = torch.stack([self._uniform(r) for r in requests]).to(device)  # [B]
        cdf = probs.cumsum(dim=-1)
        target = uniform[:, None] * cdf[:, -1:]
        # right=True: the first token whose cumulative mass exceeds the draw, never a zero-mass one.
        sampled = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[1] - 1)[:, 0]
        greedy = torch.tensor([p.is_greedy for p in params], device=device)
        chosen = torch.where(greedy, logits.argmax(dim=-1), sampled)
        token_ids = chosen.tolist()
        return SamplerOutput(token_ids, compute_logprobs(raw_logits, token_ids, [p.logprobs for p in params]))

    def _uniform(self, request: Request) -> torch.Tensor:
        seed = request.params.seed
        if seed is None:
            return torch.rand((), generator=self.generator)
        generator = self.request_generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator().manual_seed(seed)
            self.request_generators[request.request_id] = generator
        return torch.rand((), generator=generator)

    @staticmethod
    def _suppress_stop_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
        """Before min_tokens are generated, no stop token may be drawn."""
        for row, request in enumerate(requests):
            if len(request.output_token_ids) < request.params.min_tokens:
                stops = set(request.params.stop_token_ids)
                if not request.params.ignore_eos:
                    stops |= request.eos_token_ids
                if stops:
                    logits[row, list(stops)] = float("-inf")


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> None:
    """In place. Presence and frequency penalties count generated tokens; the repetition penalty
    (divide positive logits, multiply negative ones) applies to prompt and generated tokens."""
    batch, vocab = logits.shape
    counts = torch.zeros(batch, vocab, device=logits.device)
    seen = torch.zeros(batch, vocab, dtype=torch.bool, device=logits.device)
    for row, request in enumerate(requests):
        if request.output_token_ids:
            out = torch.tensor(request.output_token_ids, device=logits.device)
            counts[row].index_add_(0, out, torch.ones_like(out, dtype=counts.dtype))
        if request.params.repetition_penalty != 1.0:
            seen[row, torch.tensor(request.all_token_ids, device=logits.device)] = True
    presence = torch.tensor([r.params.presence_penalty for r in requests], device=logits.device)[:, None]
    frequency = torch.tensor([r.params.frequency_penalty for r in requests], device=logits.device)[:, None]
    repetition = torch.tensor([r.params.repetition_penalty for r in requests], device=logits.device)[:, None]
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits.copy_(torch.where(seen, penalized, logits))
    logits.sub_(frequency * counts + presence * (counts > 0))


def apply_top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits (ties at the k-th value are kept)."""
    sorted_logits = logits.sort(dim=-1, descending=True).values
    kth = sorted_logits.gather(1, (k - 1).clamp(min=0)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (always at least one)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p[:, None]
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return probs.masked_fill(drop, 0.0)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the row's most likely token."""
    threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
    return probs.masked_fill(probs < threshold, 0.0)


def compute_logprobs(
    logits: torch.Tensor, token_ids: list[int], num_top: list[int | None]
) -> list[TokenLogprobs | None]:
    """Log-probabilities under the model's own distribution (before sampling filters)."""
    if all(k is None for k in num_top):
        return [None] * len(token_ids)
    rows = [i for i, k in enumerate(num_top) if k is not None]
    logprobs = torch.log_softmax(logits[rows], dim=-1)
    widest = max(num_top[i] for i in rows)
    top_values, top_ids = logprobs.topk(max(widest, 1), dim=-1)
    chosen = logprobs.gather(1, torch.tensor([[token_ids[i]] for i in rows], device=logits.device))
    result: list[TokenLogprobs | None] = [None] * len(token_ids)
    for j, i in enumerate(rows):
        k = num_top[i]
        top = tuple(zip(top_ids[j, :k].tolist(), top_values[j, :k].tolist()))
        result[i] = TokenLogprobs(token_ids[i], float(chosen[j, 0]), top)
    return result
