"""Speculative decoding: draft tokens proposed cheaply, verified by the model in one step.

Two sources of drafts. Prompt lookup (`NgramProposer`, no second model): a decoding sequence whose last n
tokens (n from `max_ngram` down to `min_ngram`) occurred earlier in its prompt or output proposes the
tokens that followed that occurrence, the most recent one. A draft model (`engine/draft_model.py`): a
smaller model of the same vocabulary decodes k greedy tokens ahead. Either way the step then runs the
last sampled token and the k drafts as one chunk and gets k + 1 rows of logits; the sampler
(`Sampler.verify`) keeps the drafts the model agrees with and adds one token of its own, so a step yields
1 to k + 1 tokens for about the cost of one where weights, not arithmetic, bound a step. Outputs that
copy their input (summaries, edits, code, extraction) accept most lookup drafts; other text rarely finds
an n-gram of 2 or more to propose from, and a request whose drafts keep failing proposes fewer (down to
none, retried now and then), so it pays little.

Only requests whose next-token distribution does not depend on the tokens just drafted speculate:
no penalties (they count the output), no grammar (its state advances per token), past min_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.request import Request
from engine.sampling_params import MAX_SPECULATIVE_TOKENS

MIN_NGRAM = 2  # a one-token match proposes from almost any text, and is mostly wrong
MAX_NGRAM = 4
# The step count after which a request whose drafts all failed tries again with one draft.
RETRY_AFTER = 8
# Beside other decoding sequences a verify step's extra rows cost nearly their full price (the step is
# no longer bound by reading weights alone), so there a request speculates only while at least this share
# of its drafts has been accepted, once it has proposed LEARN_DRAFTS of them. At one sequence any share pays.
MIN_BATCHED_ACCEPTANCE = 0.7
LEARN_DRAFTS = 16


@dataclass
class DraftState:
    """One request's speculation: how many drafts it proposes now, and its counts."""

    limit: int  # drafts per step asked for (the request's or the server's)
    width: int  # drafts per step now: halved when none is accepted, doubled when all are (up to limit)
    idle_steps: int = 0  # steps since the width fell to 0
    proposed: int = 0
    accepted: int = 0


class Proposer:
    """What every draft source shares: who speculates, how many drafts each proposes now (narrowed when
    drafts fail, widened when they pass), and the acceptance counts. A source implements `draft`."""

    def __init__(self, default_tokens: int = 0, max_batch: int = 4) -> None:
        if not 0 <= default_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], got {default_tokens}")
        if max_batch < 1:
            raise ValueError(f"speculative max batch must be at least 1, got {max_batch}")
        self.default_tokens = default_tokens  # drafts per step for requests that do not ask (0: off unless asked)
        self.max_batch = max_batch  # decoding sequences above which nobody speculates: the step is arithmetic-bound
        self.states: dict[str, DraftState] = {}  # request id -> its speculation (totals: EngineStats)

    def limit(self, request: Request) -> int:
        asked = request.params.speculative_tokens
        return self.default_tokens if asked is None else asked

    def propose(self, decoding: list[Request], max_model_len: int) -> dict[Request, list[int]]:
        """Drafts for the requests about to decode (those whose tokens are all computed but the last)."""
        if len(decoding) > self.max_batch:
            return {}
        widths: dict[Request, int] = {}
        for request in decoding:
            k = self._width(request)
            if len(decoding) > 1 and not self._passes_beside_others(request):
                continue
            # Every token the step may yield must fit max_tokens and the context: k drafts + 1.
            k = min(k, request.params.max_tokens - len(request.output_token_ids) - 1,
                    max_model_len - request.num_tokens - 1)
            if k > 0:
                widths[request] = k
        return {request: draft for request, draft in self.draft(widths).items() if draft} if widths else {}

    def draft(self, widths: dict[Request, int]) -> dict[Request, list[int]]:
        """Up to widths[r] draft tokens to follow each request r's tokens."""
        raise NotImplementedError

    def record(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """A verify step's outcome for the request: widen or narrow its drafts. Called before the step's
        tokens are appended to the request."""
        state = self.states[request.request_id]
        state.proposed += num_proposed
        state.accepted += num_accepted
        if num_accepted == num_proposed:
            state.width = min(state.limit, max(1, 2 * state.width))
        elif num_accepted == 0:
            state.width //= 2

    def forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def close(self) -> None:
        """Release what the source holds (a draft model's cache)."""

    def _passes_beside_others(self, request: Request) -> bool:
        state = self.states.get(request.request_id)
        if state is None or state.proposed < LEARN_DRAFTS:
            return True
        return state.accepted >= MIN_BATCHED_ACCEPTANCE * state.proposed

    def _width(self, request: Request) -> int:
        if request.matcher is not None or request.held_matcher is not None or request.params.has_penalties:
            return 0
        if request.params.reasoning_budget is not None and request.in_reasoning is not False:  # it may be forced
            return 0
        if len(request.output_token_ids) < request.params.min_tokens:
            return 0
        state = self.states.get(request.request_id)
        if state is None:
            limit = self.limit(request)
            if limit == 0:
                return 0
            state = self.states[request.request_id] = DraftState(limit, limit)
        if state.width == 0:
            state.idle_steps += 1
            if state.idle_steps >= RETRY_AFTER:
                state.idle_steps, state.width = 0, 1
        return state.width


class NgramProposer(Proposer):
    """Drafts by prompt lookup: what followed the sequence's last few tokens where they occurred before."""

    def __init__(self, default_tokens: int = 0, max_batch: int = 4, min_ngram: int = MIN_NGRAM,
                 max_ngram: int = MAX_NGRAM) -> None:
        super().__init__(default_tokens, max_batch)
        self.min_ngram, self.max_ngram = min_ngram, max_ngram

    def draft(self, widths: dict[Request, int]) -> dict[Request, list[int]]:
        return {request: ngram_draft(request.all_token_ids, k, self.min_ngram, self.max_ngram)
                for request, k in widths.items()}


def ngram_draft(tokens: list[int], k: int, min_ngram: int = MIN_NGRAM, max_ngram: int = MAX_NGRAM) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the sequence's last n tokens,
    for the longest n in [min_ngram, max_ngram] that occurred; [] when none did."""
    length = len(tokens)
    if length <= min_ngram:
        return []
    seq = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        tail = seq[length - n:]
        # Starts i < length - n whose window equals the tail: test the first token, then the rest.
        starts = np.flatnonzero(seq[:length - n] == tail[0])
        for offset in range(1, n):
            if not len(starts):
                break
            starts = starts[seq[starts + offset] == tail[offset]]
        if len(starts):
            follow = int(starts[-1]) + n  # the most recent occurrence
            return seq[follow:follow + k].tolist()
    return []
