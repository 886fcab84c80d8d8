"""Decode speed of step models side by side: eager fp32 and an artifact, interleaved in one run.

Each model gets its own batch of prompts, prefilled once; then rounds of decode steps alternate between
the models, so a slow spell on a shared machine lands on both sides instead of skewing one. A figure is
the median step time over every timed step of that model. Both sides run the same driver
(`model.sequences.Sequences`), so the ratio compares the models, not the harness.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import torch

from kernels.timing import time_calls
from model.sequences import Sequences
from model.step import StepModel

PROMPT_LEN = 128
WARMUP_STEPS = 3
ROUNDS = 4
STEPS_PER_ROUND = 6


@dataclass
class DecodeSpeed:
    batch: int
    median_step_ms: float
    tokens_per_s: float
    steps: int

    def to_dict(self) -> dict:
        return asdict(self)


class _Decoder:
    """One model decoding its own batch greedily, one timed step at a time."""

    def __init__(self, model: StepModel, prompts: list[list[int]], max_len: int) -> None:
        self.seqs = Sequences(model, len(prompts), max_len)
        self.logits = self.seqs.step(prompts)
        self.times: list[float] = []  # seconds of each timed step

    def step(self) -> None:
        tokens = self.logits.argmax(dim=-1).tolist()  # waits for the previous step's work
        self.logits = self.seqs.step([[t] for t in tokens])


def compare_decode(models: dict[str, StepModel], batch: int, vocab_size: int, prompt_len: int = PROMPT_LEN,
                   rounds: int = ROUNDS, steps: int = STEPS_PER_ROUND) -> dict[str, DecodeSpeed]:
    """Decode speed of each model at `batch` sequences of `prompt_len` tokens, rounds interleaved."""
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab_size, (batch, prompt_len), generator=generator).tolist()
    max_len = prompt_len + WARMUP_STEPS + rounds * steps + 1
    decoders = {name: _Decoder(model, prompts, max_len) for name, model in models.items()}
    for decoder in decoders.values():
        for _ in range(WARMUP_STEPS):  # first calls: allocation, and compilation for compiled models
            decoder.step()
    for _ in range(rounds):
        for decoder in decoders.values():
            # On CUDA a step is timed with events on the stream and waited for (kernels/timing.py), so
            # queued kernels are not mistaken for finished ones; host work counts, as it does for the engine.
            timing = time_calls(decoder.step, warmup=0, min_reps=steps, device=decoder.seqs.model.device)
            decoder.times.extend(timing.samples_s)
    speeds = {}
    for name, decoder in decoders.items():
        median = statistics.median(decoder.times)
        speeds[name] = DecodeSpeed(batch, median * 1e3, batch / median, len(decoder.times))
    return speeds
