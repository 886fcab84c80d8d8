"""The reference sampler: every filter sorts the whole vocabulary of every row.

What `engine.sampler.Sampler` computed before its filters looked at short candidate lists; the Sampler
must give the same tokens and logprobs (tests/engine/test_sampler.py) and is timed against it
(benchmarks/sampler_bench.py). Rows without filters are drawn as the Sampler draws them (one C++ call,
tested against its own torch reference in tests/kernels/test_cpu_sampling.py). One difference is by
design: here, once any row of a batch uses top-p, every row goes through it, and a row whose top_p is 1
loses the tail tokens whose preceding mass rounds to 1 in float32; the Sampler leaves such a row alone,
so its draws never depend on its batch.
"""

from __future__ import annotations

import torch

from engine.guide_masks import StepMasks
from engine.request import Request
from engine.sampler import (
    FLOAT32_MAX,
    Sampler,
    SamplerOutput,
    apply_min_p,
    apply_penalties,
    compute_logprobs,
    draw,
    uniform_tensor,
)


class FullSortSampler(Sampler):
    def _sample_filtered(self, logits: torch.Tensor, requests: list[Request], uniform_numbers: list[float],
                         masks: StepMasks | None = None) -> SamplerOutput:
        """logits [B, V] float32, one row per request, in order: the rows that take a filter (the others
        are drawn as the Sampler draws them, by kernels/cpu_sampling.py). No grammar masks."""
        if masks is not None:
            raise ValueError("the full-sort reference takes no grammar masks")
        uniform = uniform_tensor(uniform_numbers, logits.device)  # [B]
        raw_logits = logits
        logits = logits.clone()
        device = logits.device
        params = [r.params for r in requests]
        if any(p.has_penalties for p in params):
            apply_penalties(logits, requests)
        temperature = torch.tensor([1.0 if p.is_greedy else p.temperature for p in params], device=device)
        logits.div_(temperature[:, None]).clamp_(-FLOAT32_MAX, FLOAT32_MAX)
        self._suppress_stop_tokens(logits, requests)
        top_k = [p.top_k for p in params]
        if any(top_k):
            vocab = logits.shape[1]
            k = torch.tensor([min(k, vocab) or vocab for k in top_k], device=device)
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1).clamp(min=0)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        top_p = [p.top_p for p in params]
        if any(p < 1.0 for p in top_p):
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop_sorted = mass_before >= torch.tensor(top_p, device=device)[:, None]
            drop_sorted[:, 0] = False  # the most likely token always stays
            probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted), 0.0)
        min_p = [p.min_p for p in params]
        if any(min_p):
            probs = apply_min_p(probs, torch.tensor(min_p, device=device))
        sampled = draw(probs, uniform)
        greedy = torch.tensor([p.is_greedy for p in params], device=device)
        token_ids = torch.where(greedy, logits.argmax(dim=-1), sampled).tolist()
        return SamplerOutput(token_ids, compute_logprobs(raw_logits, token_ids, [p.logprobs for p in params]))
