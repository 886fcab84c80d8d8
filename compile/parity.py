"""The parity report: an artifact against fp32 eager on the same inputs.

Three measures, all through the step interface the engine drives (model/step.py), on the `Sequences`
driver:
- logits: max and mean absolute difference over every position of a few prompts;
- greedy: tokens equal to eager's over 64 greedy steps of fixed prompts (and where the first
  divergence was, with eager's top-2 margin there, since a near tie may flip under any rounding);
- perplexity on a built-in English text (Python's own `pydoc_data.topics`), and its change vs fp32.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from model.perplexity import PERPLEXITY_TOKENS, corpus_text, token_nll
from model.sequences import Sequences
from model.step import StepModel

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
    "Photosynthesis is the process by which green plants",
)
GREEDY_TOKENS = 64


def greedy(model: StepModel, prompts: list[list[int]], num_tokens: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy continuations of every prompt, decoded as one batch; also each step's logits [S, vocab]."""
    seqs = Sequences(model, len(prompts), max(map(len, prompts)) + num_tokens)
    logits = seqs.step(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    history = []
    for _ in range(num_tokens):
        history.append(logits)
        next_ids = logits.argmax(dim=-1).tolist()
        for out, token in zip(outputs, next_ids):
            out.append(token)
        logits = seqs.step([[t] for t in next_ids])
    return outputs, history


@dataclass
class ParityReport:
    max_abs_logit_diff: float
    mean_abs_logit_diff: float
    greedy_tokens_compared: int
    greedy_tokens_equal: int  # positions equal before each prompt's first divergence, summed
    greedy_first_divergence: list[int | None]  # per prompt: step of the first different token
    greedy_divergence_margin: list[float | None]  # eager's top-2 logit gap at that step (small = near tie)
    # Fed eager's greedy tokens, how often the artifact's own best token is eager's (no cascading after
    # a first difference, unlike free-running greedy above).
    teacher_forced_top1_agreement: float
    perplexity_tokens: int
    perplexity: float
    perplexity_fp32: float
    perplexity_change: float  # relative: (ppl - ppl_fp32) / ppl_fp32

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Reference:
    """What fp32 eager gives on the parity inputs, computed once per compile."""

    prompt_ids: list[list[int]]
    prefill_logits: torch.Tensor  # [sum of prompt lengths, vocab]
    greedy: list[list[int]]
    greedy_logits: list[torch.Tensor]
    corpus_ids: list[int]
    perplexity: float


def encode_inputs(tokenizer, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """Prompts and the corpus as token ids (a model without a tokenizer gets fixed pseudo-random ids)."""
    if tokenizer is not None:
        prompts = [tokenizer.encode(p) for p in PROMPTS]
        corpus = tokenizer.encode(corpus_text(), add_special_tokens=False)[:PERPLEXITY_TOKENS]
        return prompts, corpus
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in (5, 17, 33, 9)]
    corpus = torch.randint(0, vocab_size, (PERPLEXITY_TOKENS,), generator=generator).tolist()
    return prompts, corpus


def reference(model: StepModel, prompt_ids: list[list[int]], corpus_ids: list[int],
              greedy_tokens: int = GREEDY_TOKENS) -> Reference:
    prefill = Sequences(model, len(prompt_ids), max(map(len, prompt_ids))).step(prompt_ids, all_rows=True)
    outputs, history = greedy(model, prompt_ids, greedy_tokens)
    ppl = math.exp(token_nll(model, corpus_ids).mean().item())
    return Reference(prompt_ids, prefill.cpu(), outputs, [h.cpu() for h in history], corpus_ids, ppl)


def compare(model: StepModel, ref: Reference) -> ParityReport:
    prefill = Sequences(model, len(ref.prompt_ids), max(map(len, ref.prompt_ids))).step(ref.prompt_ids, all_rows=True)
    diff = (prefill.cpu() - ref.prefill_logits).abs()
    outputs, _ = greedy(model, ref.prompt_ids, len(ref.greedy[0]))
    equal, first, margins = 0, [], []
    for s, (got, want) in enumerate(zip(outputs, ref.greedy)):
        step = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        first.append(step)
        equal += len(want) if step is None else step
        if step is None:
            margins.append(None)
        else:
            top2 = ref.greedy_logits[step][s].topk(2).values
            margins.append(float(top2[0] - top2[1]))
    forced = Sequences(model, len(ref.prompt_ids), max(map(len, ref.prompt_ids)) + len(ref.greedy[0]))
    contexts = [p + g[:-1] for p, g in zip(ref.prompt_ids, ref.greedy)]
    logits = forced.step(contexts, all_rows=True)  # rows of each sequence end to end
    agree, start = 0, 0
    for prompt, want in zip(ref.prompt_ids, ref.greedy):
        rows = logits[start + len(prompt) - 1: start + len(prompt) - 1 + len(want)]
        agree += int((rows.argmax(dim=-1).cpu() == torch.tensor(want)).sum())
        start += len(prompt) + len(want) - 1
    ppl = math.exp(token_nll(model, ref.corpus_ids).mean().item())
    return ParityReport(
        max_abs_logit_diff=float(diff.max()), mean_abs_logit_diff=float(diff.mean()),
        greedy_tokens_compared=sum(map(len, ref.greedy)), greedy_tokens_equal=equal,
        greedy_first_divergence=first, greedy_divergence_margin=margins,
        teacher_forced_top1_agreement=agree / sum(map(len, ref.greedy)),
        perplexity_tokens=len(ref.corpus_ids), perplexity=ppl, perplexity_fp32=ref.perplexity,
        perplexity_change=(ppl - ref.perplexity) / ref.perplexity,
    )
