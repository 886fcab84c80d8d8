"""The next token of rows that take no sampling filter, as one C++ call (kernels/csrc/sampling.cpp).

After a decode step has streamed the model's weights through the caches, each distinct torch op pays tens
of microseconds to bring its code back: the softmax, cumulative sum and search of the batched sampler
(engine/sampler.py) cost ~0.3 ms a batch-1 step that way. `sample_rows` draws every row in one call.

A greedy row (temperature 0) takes its first maximum; a sampled row the first token whose running sum of
weights w = exp(clamp(x / T) - max) exceeds u * sum(w), with weights below e^-87 of the largest at 0
(so a -inf logit has no mass). A row holding a NaN gets -1. `sample_rows_ref` is the same in plain torch,
its sums in float64 token by token: the kernel's block sums round differently, so the two agree except
where u * sum(w) lies within float32 rounding of a boundary between two tokens.
"""

from __future__ import annotations

import functools
import math

import torch

from kernels.cpu_extension import cpu_kernels_enabled, cpu_op, load

FLOAT32_MAX = torch.finfo(torch.float32).max
FLOAT32_TINY = torch.finfo(torch.float32).tiny  # below this a temperature is greedy: x / T overflows
FLUSH = -87.0  # weights exp(d) with d below this are 0


def sample_rows_ref(logits: torch.Tensor, temperature: list[float], uniform: list[float]) -> torch.Tensor:
    """logits [B, V] float32, temperature [B] (0: greedy), uniform [B] in [0, 1) -> [B] int64, -1 for a
    row with a NaN."""
    tokens = []
    for x, t, u in zip(logits.float(), temperature, uniform):
        t32 = float(torch.tensor(t, dtype=torch.float32))
        if x.isnan().any():
            tokens.append(-1)
        elif not t32 >= FLOAT32_TINY:
            tokens.append(int(x.argmax()))
        else:
            z = (x / t32).clamp(-FLOAT32_MAX, FLOAT32_MAX)
            d = z - z.max()
            w = torch.where(d >= FLUSH, d.exp(), torch.zeros_like(d)).double()
            running = w.cumsum(0)
            total = float(running[-1])
            target = min(u * total, math.nextafter(total, 0.0))
            tokens.append(int(torch.searchsorted(running, torch.tensor([target], dtype=torch.float64), right=True)))
    return torch.tensor(tokens, dtype=torch.int64, device=logits.device)


_sample_rows = cpu_op("sample_rows", sample_rows_ref,
                      lambda logits, temperature, uniform: logits.new_empty(logits.shape[:1], dtype=torch.int64))


@functools.cache
def available() -> bool:
    """Whether the C++ kernel runs here (else `sample_rows` would run the row-by-row reference)."""
    return cpu_kernels_enabled() and load() is not None


def sample_rows(logits: torch.Tensor, temperature: list[float], uniform: list[float]) -> list[int]:
    """The token of each row of logits [B, V] float32 on the CPU, as `sample_rows_ref` draws it; -1 for a
    row with a NaN."""
    return _sample_rows(logits, temperature, uniform).tolist()
