"""The token masks of a step's guided rows, computed beside the forward pass.

Before the forward pass starts, the engine hands the rows to sample that carry a matcher to `GuideMasker`,
which computes their masks on a worker thread (llguidance's mask code runs without the GIL, and the forward
pass spends most of its time in torch ops that release it too); the sampler waits for them only after the
forward pass. A mask is computed from the tokens already chosen, so it depends on nothing the forward
pass produces.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import llguidance
import torch

if TYPE_CHECKING:
    from engine.guide import GuideCompiler

log = logging.getLogger(__name__)

GUIDE_FAILED = "the output constraint of this request failed"
# A client's error (400): the constraint forces text the model's tokens cannot write.
GUIDE_UNWRITABLE = ("the output constraint requires byte 0x{:02X} next, which no token of this model's vocabulary "
                    "holds, so the output cannot continue")


@dataclass(frozen=True)
class StepMasks:
    """rows: the step's sample rows (ascending) that are guided; allowed [len(rows), V] bool, True where the
    token may come next; errors: row -> why its matcher failed (that request ends with an error)."""

    rows: list[int]
    allowed: torch.Tensor
    errors: dict[int, str] = field(default_factory=dict)


class GuideMasker:
    def __init__(self, vocab_size: int, compiler: GuideCompiler | None = None) -> None:
        self.vocab_size = vocab_size
        self.compiler = compiler  # the vocabulary's facts: bytes no token holds, tokens llguidance marks
        self.words = (vocab_size + 31) // 32  # llguidance writes 32 tokens per int32 word
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ladder-guide")
        # One Rust thread per row is wasted on a small batch; two suit the 2-core hosts this serves on and
        # larger machines keep one core for it beside the model's.
        self._executor = llguidance.LLExecutor(num_threads=2)
        self._bits = torch.arange(32, dtype=torch.int32)

    def start(self, matchers: list[llguidance.LLMatcher | None], openings: list[int | None] | None = None,
              forced: list[int | None] | None = None) -> Future[StepMasks] | None:
        """Start computing the masks of the rows whose matcher is not None, or that must take one token
        (`forced`: a reasoning block's end once its budget is spent); None when there are none.
        `openings`: per row, a token allowed beside the grammar (a reasoning block's start), or None."""
        forced = forced or [None] * len(matchers)
        rows = [i for i, m in enumerate(matchers) if m is not None or forced[i] is not None]
        if not rows:
            return None
        extra = [openings[i] for i in rows] if openings is not None else [None] * len(rows)
        return self._pool.submit(self._compute, rows, [matchers[i] for i in rows], extra, [forced[i] for i in rows])

    def _compute(self, rows: list[int], matchers: list[llguidance.LLMatcher | None], openings: list[int | None],
                 forced: list[int | None]) -> StepMasks:
        bitmask = torch.zeros(len(rows), self.words, dtype=torch.int32)  # [R, W], bit j of word w: token 32w + j
        try:
            guided = [(m, j) for j, m in enumerate(matchers) if m is not None]
            if guided:
                self._executor.unsafe_compute_mask_ptr(guided, bitmask.data_ptr(), self.words * 4, len(rows))
        except Exception:  # the guided requests fail, not the step (the unguided rows never wait on this)
            log.exception("computing the token masks of %d guided rows failed", len(rows))
            return StepMasks(rows, torch.ones(len(rows), self.vocab_size, dtype=torch.bool),
                             {row: GUIDE_FAILED for row in rows})
        allowed = ((bitmask[:, :, None] >> self._bits) & 1).bool().reshape(len(rows), -1)[:, :self.vocab_size]
        errors = {}
        unwritable = self.compiler.unwritable if self.compiler is not None else frozenset()
        marked = self.compiler.marked_tokens if self.compiler is not None else None
        if marked is not None and marked.numel():
            # A marked token the mask allows is kept only if the matcher takes it (a grammar that names it,
            # `<think>` in Lark); where the grammar only has its text, the text is written in other tokens.
            for j, k in (allowed[:, marked]).nonzero().tolist():
                token = int(marked[k])
                if matchers[j] is not None and not matchers[j].validate_tokens([token]):
                    allowed[j, token] = False
        for j, token in enumerate(openings):
            if token is not None:
                allowed[j, token] = True
        for j, token in enumerate(forced):
            if token is not None:  # the one token this row may take
                allowed[j] = False
                allowed[j, token] = True
        for j, m in enumerate(matchers):
            if m is None:
                continue
            # A matcher in error (it never should be: tokens come from its own masks) allows nothing.
            if m.is_error() or not allowed[j].any():
                errors[rows[j]] = GUIDE_FAILED
                allowed[j] = True  # so the row samples like the others; its request ends with the error
            elif unwritable and (needed := unwritable.intersection(m.compute_ff_bytes())):
                # Forced text with a byte no token holds: llguidance's mask then allows a token that its
                # matcher refuses. The request ends here, with the reason.
                errors[rows[j]] = GUIDE_UNWRITABLE.format(min(needed))
                allowed[j] = True
        return StepMasks(rows, allowed, errors)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
