"""Decode and prefill sweeps: the model's forward alone, timed at growing batch sizes on its own caches.

Decode at batch b: b sequences of `context` cached tokens each add one token. Prefill of n tokens: one
prompt of n tokens from an empty cache. The sequences use disjoint blocks from the front of the cache;
what they write there is never read by anything else (the prefix cache only knows blocks the engine
computed itself).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from doctor.cost import ModelCost
from doctor.roofline import RooflinePoint
from kernels.kv_layout import blocks_for_tokens
from kernels.timing import time_calls
from model.step import SeqChunk, StepModel, build_step, keeps_states, run_step


def powers_up_to(limit: int, start: int = 1) -> list[int]:
    """start, 2 start, 4 start, ... and `limit` itself."""
    values, value = [], start
    while value < limit:
        values.append(value)
        value *= 2
    return values + [limit]


def time_step(model: StepModel, kv_caches: list[torch.Tensor], chunks: list[SeqChunk], reps: int,
              budget: float) -> float:
    """Best seconds of the model's forward on `chunks` (inputs built once, outside the timing)."""
    inputs = build_step(chunks, model.block_size, model.device)
    # The first call is a warm-up: first-call allocations and kernel choices.
    return time_calls(lambda: run_step(model, inputs, kv_caches), warmup=1, min_reps=1, max_reps=reps,
                      max_time=budget, device=model.device).best_s


def decode_chunks(batch: int, context: int, block_size: int, states: bool = False) -> list[SeqChunk]:
    """`states`: sequence i keeps its linear-attention state in slot i (a model with such layers)."""
    per_seq = blocks_for_tokens(context + 1, block_size)
    # Token 1 everywhere: the values do not change the work, and id 1 exists in every vocabulary.
    return [SeqChunk([1], context, list(range(i * per_seq, (i + 1) * per_seq)), state_slot=i if states else -1)
            for i in range(batch)]


def prefill_chunks(num_tokens: int, block_size: int, states: bool = False) -> list[SeqChunk]:
    return [SeqChunk([1] * num_tokens, 0, list(range(blocks_for_tokens(num_tokens, block_size))),
                     state_slot=0 if states else -1)]


def cache_capacity(model: StepModel, kv_caches: list[torch.Tensor]) -> tuple[int, int | None]:
    """(KV blocks, state slots) of the caches: the attention layers' blocks, and the linear-attention layers' rows
    (None without such layers)."""
    config = model.config
    blocks = next(c.shape[1] for i, c in enumerate(kv_caches) if not config.is_linear_layer(i))
    slots = next((c.shape[0] for i, c in enumerate(kv_caches) if config.is_linear_layer(i)), None)
    return blocks, slots


def run_sweeps(model: StepModel, kv_caches: list[torch.Tensor], cost: ModelCost, max_batch: int, context: int,
               max_prefill: int, reps: int = 3,
               on_progress: Callable[[str], None] = lambda _: None) -> list[RooflinePoint]:
    num_blocks, num_slots = cache_capacity(model, kv_caches)
    states = keeps_states(model)
    block_size = model.block_size
    points: list[RooflinePoint] = []
    for batch in powers_up_to(max_batch):
        if batch * blocks_for_tokens(context + 1, block_size) > num_blocks or batch > (num_slots or batch):
            break
        on_progress(f"decode sweep: batch {batch} at context {context}")
        seconds = time_step(model, kv_caches, decode_chunks(batch, context, block_size, states), reps, budget=1.0)
        points.append(RooflinePoint(f"decode b={batch}", "decode", batch, seconds, cost.decode_step(batch, context)))
    for num_tokens in powers_up_to(max_prefill, start=16):
        if blocks_for_tokens(num_tokens, block_size) > num_blocks:
            break
        on_progress(f"prefill sweep: {num_tokens} tokens")
        seconds = time_step(model, kv_caches, prefill_chunks(num_tokens, block_size, states), reps, budget=1.0)
        points.append(RooflinePoint(f"prefill {num_tokens}", "prefill", num_tokens, seconds,
                                    cost.prefill_step(num_tokens)))
    return points
