"""Decode speed of a step model: single-stream and batched tokens/s, with eager fp32 as the baseline.

Each figure is the median over timed decode steps (after warm-up steps, which also absorb any
compilation), so one slow step on a shared machine does not move it. Both sides run the same driver
(`parity.Sequences`), so the ratio compares the models, not the harness.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from compile.parity import Sequences, StepModel

PROMPT_LEN = 128
WARMUP_STEPS = 3
TIMED_STEPS = 16


@dataclass
class DecodeSpeed:
    batch: int
    median_step_ms: float
    tokens_per_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def decode_speed(model: StepModel, batch: int, prompt_len: int = PROMPT_LEN, steps: int = TIMED_STEPS,
                 vocab_size: int = 1000) -> DecodeSpeed:
    """Prefill `batch` prompts of `prompt_len` tokens, then time `steps` decode steps of the whole batch."""
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab_size, (batch, prompt_len), generator=generator).tolist()
    seqs = Sequences(model, batch, prompt_len + WARMUP_STEPS + steps + 1)
    logits = seqs.step(prompts)
    times = []
    for i in range(WARMUP_STEPS + steps):
        tokens = logits.argmax(dim=-1).tolist()
        start = time.perf_counter()
        logits = seqs.step([[t] for t in tokens])
        if i >= WARMUP_STEPS:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return DecodeSpeed(batch, median * 1e3, batch / median)
