"""Choosing the next token of every sequence in one batched call.

Each row draws one uniform number (from the request's own generator when it has a seed, so a seeded
request samples the same tokens whatever else is in the batch) and picks the token where that number
falls in its cumulative distribution; greedy rows take the argmax. A row whose request takes no filter
(the API's default, and every greedy row without penalties, bias or grammar) is drawn by one C++ call for
all such rows (kernels/cpu_sampling.py) on a CPU: after a decode step each distinct torch op pays tens of
microseconds to bring its code back into the caches, and the dozen ops below cost ~0.3 ms that way. The
other rows go through penalties, temperature, top-k, top-p and min-p as tensor ops over per-row
parameters. A row always takes the same way, whatever else its batch holds.

Top-k and top-p need each row's most likely tokens in order. Sorting the whole vocabulary (49,152 tokens
for the default model) every step costs milliseconds per row, so a filter looks only at the rows that
use it, and top-p first at a short `topk` list of candidates: the kept set is exactly what a full sort
would keep whenever the candidates' mass reaches top_p (the rare row where it does not, or where equal
probabilities straddle the cut, is sorted in full as before). Every probability and cumulative sum is
computed by the same operations as with a full sort, so the draws, tokens and logprobs are the same.

Sampling is total: for every parameter value `SamplingParams` accepts, alone or combined, each row gets a
token id in range and finite logprobs. The arithmetic that makes it so:
- Penalties and temperature edit float32 logits; a value pushed past float32's range (a repetition
  penalty of 1e-300 is 0 in float32, and a positive logit divided by it is +inf) is clamped to the
  largest finite float, so the softmax (which subtracts the row's maximum) never sees inf - inf. Tokens
  pushed to the same bound share the top of the distribution, the limit of what the penalty asks.
- A logit bias is added first; stop tokens forbidden before `min_tokens` and the tokens a guided row's
  grammar forbids are set to -inf after that clamp, so no clamp revives them. A grammar that allows only
  stop tokens wins over `min_tokens` (the row would have no token left otherwise).
- Top-p always keeps the most likely token (a nucleus of 1e-50 is the argmax, not an empty set), top-k
  keeps at least one, min-p at most 1 keeps the maximum.
- The draw lands strictly below the row's total mass, so it never falls on a zero-mass tail token.
- A row whose model logits hold a NaN is that request's failure (an error for it alone), not a token.
- Logprobs come from the model's own logits, clamped to finite values.
If sampling a batch raises anyway, each row is sampled alone with the uniform number it already drew
(a row's token does not depend on its batch), and only the rows that fail alone end with an error.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.guide_masks import StepMasks
from engine.request import Request, TokenLogprobs
from kernels import cpu_sampling

log = logging.getLogger(__name__)

FLOAT32_MAX = torch.finfo(torch.float32).max
BELOW_ONE = 1.0 - 2.0**-24  # the largest float32 below 1
# The errors a row's request ends with when it cannot be sampled (the other rows keep their tokens).
NON_FINITE_LOGITS = "the model produced non-finite logits for this request"
SAMPLING_FAILED = "sampling the next token of this request failed"


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] int64, the first index of each row's maximum (a NaN counts as the maximum), as
    torch.argmax gives it. On a CPU through NumPy, whose argmax is vectorized: torch's scalar loop takes
    2.8 ms for 32 rows of a 49,152-token vocabulary on one thread, NumPy 0.26 ms."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        return torch.from_numpy(np.argmax(logits.detach().numpy(), axis=-1).astype(np.int64, copy=False))
    return logits.argmax(dim=-1)


def greedy_tokens(logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """[B, V] -> each row's argmax as argmax_rows gives it, and the rows the model failed (a NaN): argmax
    takes a NaN for the maximum, so a broken row shows in its chosen value, free. On a CPU all in NumPy:
    a batch-1 greedy step's sampling then costs a few microseconds, where the torch gather and nonzero
    calls of the NaN check cost about 7."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        array = logits.detach().numpy()
        token_ids = array.argmax(axis=1).tolist()
        return token_ids, [i for i, j in enumerate(token_ids) if math.isnan(array[i, j])]
    chosen = logits.argmax(dim=-1)
    return chosen.tolist(), logits.gather(1, chosen[:, None])[:, 0].isnan().nonzero()[:, 0].tolist()


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]  # a failed row's entry is 0 and means nothing
    logprobs: list[TokenLogprobs | None]
    errors: list[str | None] = field(default_factory=list)  # per row: None, or why its request failed

    def error(self, row: int) -> str | None:
        return self.errors[row] if self.errors else None


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = random.Random(seed)  # for requests without a seed
        self.request_generators: dict[str, random.Random] = {}

    def forget(self, request_id: str) -> None:
        self.request_generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, requests: list[Request], masks: StepMasks | None = None) -> SamplerOutput:
        """logits [B, V] float32, one row per request, in order; `masks` the allowed tokens of the guided
        rows (engine/guide_masks.py)."""
        # Every row draws first, greedy ones too, so each generator's stream does not depend on the batch,
        # and a row sampled again alone (below) uses the number it drew here.
        uniform = [self._uniform(r) for r in requests]
        try:
            return self._sample(logits, requests, uniform, masks)
        except Exception:
            log.exception("sampling a batch of %d rows failed; sampling each row alone", len(requests))
            return self._sample_alone(logits, requests, uniform, masks)

    def _sample_alone(self, logits: torch.Tensor, requests: list[Request], uniform: list[float],
                      masks: StepMasks | None) -> SamplerOutput:
        token_ids: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        errors: list[str | None] = []
        for i, request in enumerate(requests):
            try:
                one = self._sample(logits[i:i + 1], [request], uniform[i:i + 1], row_masks(masks, i))
                token_ids.append(one.token_ids[0])
                logprobs.append(one.logprobs[0])
                errors.append(one.error(0))
            except Exception:
                log.exception("sampling request %s failed; it ends with an error", request.request_id)
                token_ids.append(0)
                logprobs.append(None)
                errors.append(SAMPLING_FAILED)
        return SamplerOutput(token_ids, logprobs, errors)

    def _sample(self, logits: torch.Tensor, requests: list[Request], uniform: list[float],
                masks: StepMasks | None = None) -> SamplerOutput:
        """The rows without filters in one C++ call (kernels/cpu_sampling.py), the others through the
        tensor ops below; each row always takes the same way, whatever its batch."""
        direct = direct_rows(logits, requests, masks)
        if len(direct) == len(requests):
            return self._sample_direct(logits, requests, uniform)
        if not direct:
            return self._sample_filtered(logits, requests, uniform, masks)
        taken = set(direct)
        others = [i for i in range(len(requests)) if i not in taken]
        parts = [(direct, self._sample_direct(logits[direct], [requests[i] for i in direct],
                                              [uniform[i] for i in direct])),
                 (others, self._sample_filtered(logits[others], [requests[i] for i in others],
                                                [uniform[i] for i in others], subset_masks(masks, others)))]
        return merge(len(requests), parts)

    @staticmethod
    def _sample_direct(logits: torch.Tensor, requests: list[Request], uniform: list[float]) -> SamplerOutput:
        params = [r.params for r in requests]
        temperature = [0.0 if p.is_greedy else p.temperature for p in params]
        token_ids = cpu_sampling.sample_rows(logits if logits.stride(-1) == 1 else logits.contiguous(),
                                             temperature, uniform)
        broken = [i for i, t in enumerate(token_ids) if t < 0]
        for i in broken:
            token_ids[i] = 0
        return finish(logits, token_ids, params, broken)

    def _sample_filtered(self, logits: torch.Tensor, requests: list[Request], uniform_numbers: list[float],
                         masks: StepMasks | None = None) -> SamplerOutput:
        raw_logits = logits
        device = logits.device
        params = [r.params for r in requests]
        all_greedy = all(p.is_greedy for p in params)
        suppress = any(len(r.output_token_ids) < r.params.min_tokens for r in requests)
        penalties = any(p.has_penalties for p in params)
        biased = any(p.logit_bias for p in params)
        if suppress or penalties or biased or masks is not None or not all_greedy:
            # Edited in place below; a plain argmax reads it as is.
            logits = logits.clone()  # [B, V]: 6 MB at batch 32 of a 49K vocabulary, a millisecond to copy
        if biased:
            apply_logit_bias(logits, params)
        if penalties:
            apply_penalties(logits, requests)
        if not all_greedy:
            temperature = torch.tensor([1.0 if p.is_greedy else p.temperature for p in params], device=device)
            logits.div_(temperature[:, None])
        if penalties or biased or not all_greedy:
            logits.clamp_(-FLOAT32_MAX, FLOAT32_MAX)  # +-inf from the edits above; see the module's notes
        if masks is not None:
            unsuppressed = logits[masks.rows] if suppress else None  # [R, V]
        if suppress:
            self._suppress_stop_tokens(logits, requests)
        if masks is not None:
            apply_masks_(logits, masks, unsuppressed)
        if all_greedy:  # no filter changes an argmax
            token_ids, broken = greedy_tokens(logits)
            return finish(raw_logits, token_ids, params, broken)
        # A row with a NaN (the model's, kept by the edits above) is its request's failure; its maximum shows
        # it in one pass (the clamp above just read the row, so it is in cache).
        broken = logits.amax(dim=-1).isnan().nonzero()[:, 0].tolist()
        if broken:
            logits[broken] = 0.0  # so the rest of the batch samples as usual
        sampled = draw(filtered_probs(logits, params), uniform_tensor(uniform_numbers, device))
        if any(p.is_greedy for p in params):
            greedy = torch.tensor([p.is_greedy for p in params], device=device)
            sampled = torch.where(greedy, argmax_rows(logits), sampled)
        return finish(raw_logits, sampled.tolist(), params, broken)

    def verify(self, logits: torch.Tensor, requests: list[Request], drafts: list[tuple[int, ...]]) -> list[Verified]:
        """Speculative drafts checked against the model (engine/speculative.py). logits [R, V] float32: request
        j's len(drafts[j]) + 1 rows, consecutive, in order (the row after its last token, then after each
        draft). Only requests without penalties, grammar or pending min_tokens speculate, so every row's
        distribution is the request's parameters applied to that row alone.

        Greedy: the drafts up to the first the argmax disagrees with are kept, then the argmax of the next
        row: the tokens decoding one at a time would give. Sampled: draft d is kept with probability p(d)
        (the draft is a point mass, so min(1, p/q) is p); the first refused one is replaced by a draw from p
        without d, renormalized, and if every draft is kept a last token is drawn from the next row. Each
        token is then distributed exactly as plain sampling would draw it."""
        verified = []
        start = 0
        for request, draft in zip(requests, drafts):
            rows = logits[start:start + len(draft) + 1]
            start += len(draft) + 1
            try:
                verified.append(self._verify(rows, request, draft))
            except Exception:
                log.exception("verifying the drafts of request %s failed; it ends with an error", request.request_id)
                verified.append(Verified([], [], SAMPLING_FAILED))
        return verified

    def _verify(self, rows: torch.Tensor, request: Request, draft: tuple[int, ...]) -> Verified:
        params = request.params
        x = rows
        if params.logit_bias:
            x = x.clone()
            apply_logit_bias(x, [params] * len(rows))
        if not params.is_greedy:
            x = x / params.temperature
        if params.logit_bias or not params.is_greedy:
            x = x.clamp(-FLOAT32_MAX, FLOAT32_MAX)
        if x.isnan().any():  # the model failed on this sequence (a NaN anywhere is not a distribution)
            return Verified([], [], NON_FINITE_LOGITS)
        if params.is_greedy:
            chosen = argmax_rows(x).tolist()
            kept = 0
            while kept < len(draft) and chosen[kept] == draft[kept]:
                kept += 1
            token_ids = [*draft[:kept], chosen[kept]]
        else:
            probs = filtered_probs(x, [params] * len(rows))  # [k + 1, V], unnormalized
            token_ids = []
            for j, p in enumerate(probs):
                if j == len(draft):  # every draft kept: the model's own next token
                    token_ids.append(int(draw(p[None], uniform_tensor([self._uniform(request)], p.device))[0]))
                    break
                if self._uniform(request) * p.sum() < p[draft[j]]:
                    token_ids.append(draft[j])
                    continue
                residual = p.clone()
                residual[draft[j]] = 0.0  # has mass: the draw fell past p(d), inside the rest
                token_ids.append(int(draw(residual[None], uniform_tensor([self._uniform(request)], p.device))[0]))
                break
        return Verified(token_ids, compute_logprobs(rows[:len(token_ids)], token_ids,
                                                    [params.logprobs] * len(token_ids)))

    def _uniform(self, request: Request) -> float:
        """A number in [0, 1) from the request's own generator (seeded), else the sampler's."""
        seed = request.params.seed
        if seed is None:
            return self.generator.random()
        generator = self.request_generators.get(request.request_id)
        if generator is None:
            generator = random.Random(seed % 2**64)  # any int, negative ones apart from their absolute value
            self.request_generators[request.request_id] = generator
        return generator.random()

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


@dataclass(frozen=True)
class Verified:
    """One request's outcome of a speculative step: its kept drafts and the model's own next token."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    error: str | None = None  # why the request failed instead (token_ids empty)


def filtered_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Tempered logits [B, V] (edited in place) -> probabilities after top-k, top-p and min-p, unnormalized
    after the filters. Each filter runs on the sampled rows that use it (a greedy row's argmax survives
    every filter)."""
    vocab = logits.shape[1]
    top_k_rows = [i for i, p in enumerate(params) if not p.is_greedy and 0 < p.top_k < vocab]
    if top_k_rows:
        apply_top_k_(logits, top_k_rows, [params[i].top_k for i in top_k_rows])
    probs = torch.softmax(logits, dim=-1)
    # A row with top_p 1 is left alone whatever else the batch holds (through the filter, it would lose
    # the tail tokens whose preceding mass rounds to 1 in float32).
    top_p_rows = [i for i, p in enumerate(params) if not p.is_greedy and p.top_p < 1.0]
    if top_p_rows:
        apply_top_p_(probs, top_p_rows, [params[i].top_p for i in top_p_rows])
    min_p = [0.0 if p.is_greedy else p.min_p for p in params]
    if any(min_p):
        probs = apply_min_p(probs, torch.tensor(min_p, device=logits.device))
    return probs


def row_masks(masks: StepMasks | None, row: int) -> StepMasks | None:
    """The masks of one row sampled alone (as row 0), or None if it is not guided."""
    if masks is None or row not in masks.rows:
        return None
    j = masks.rows.index(row)
    return StepMasks([0], masks.allowed[j:j + 1])


def direct_rows(logits: torch.Tensor, requests: list[Request], masks: StepMasks | None) -> list[int]:
    """The rows `cpu_sampling.sample_rows` draws: all of them none where the logits are not float32 on a
    CPU with the kernel built; else each row whose request has no grammar and `takes_no_filter`."""
    if (logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
            or not cpu_sampling.available()):
        return []
    guided = set(masks.rows) if masks is not None else set()
    vocab = logits.shape[1]
    return [i for i, request in enumerate(requests) if i not in guided and takes_no_filter(request, vocab)]


def takes_no_filter(request: Request, vocab: int) -> bool:
    """Whether the request's next token is the plain argmax or draw of its logits: no penalty, bias or
    pending min_tokens, and when it samples, no top-k, top-p or min-p (none changes an argmax)."""
    p = request.params
    if p.has_penalties or p.logit_bias or len(request.output_token_ids) < p.min_tokens:
        return False
    return p.is_greedy or (not 0 < p.top_k < vocab and p.top_p >= 1.0 and not p.min_p)


def subset_masks(masks: StepMasks | None, rows: list[int]) -> StepMasks | None:
    """The masks of a sub-batch made of `rows` (which hold every guided row), renumbered."""
    if masks is None:
        return None
    position = {row: j for j, row in enumerate(rows)}
    return StepMasks([position[row] for row in masks.rows], masks.allowed)


def merge(size: int, parts: list[tuple[list[int], SamplerOutput]]) -> SamplerOutput:
    """One output of `size` rows from the outputs of sub-batches, each with the rows it holds."""
    token_ids, logprobs = [0] * size, [None] * size
    errors: list[str | None] = [None] * size
    for rows, out in parts:
        for j, i in enumerate(rows):
            token_ids[i], logprobs[i], errors[i] = out.token_ids[j], out.logprobs[j], out.error(j)
    return SamplerOutput(token_ids, logprobs, errors if any(e is not None for e in errors) else [])


def uniform_tensor(values: list[float], device: torch.device | str) -> torch.Tensor:
    """Uniform numbers [R] as float32 for `draw`, each kept below 1 (float32 would round the largest up)."""
    return torch.tensor([min(u, BELOW_ONE) for u in values], dtype=torch.float32, device=device)


def apply_logit_bias(logits: torch.Tensor, params: list) -> None:
    """In place on logits [B, V]: each row's (token id, bias) pairs added."""
    rows = [row for row, p in enumerate(params) for _ in p.logit_bias]
    ids = [token for p in params for token, _ in p.logit_bias]
    bias = torch.tensor([b for p in params for _, b in p.logit_bias], dtype=logits.dtype, device=logits.device)
    logits.index_put_((torch.tensor(rows, device=logits.device), torch.tensor(ids, device=logits.device)), bias,
                      accumulate=True)


def apply_masks_(logits: torch.Tensor, masks: StepMasks, unsuppressed: torch.Tensor | None) -> None:
    """In place on logits [B, V]: a guided row's forbidden tokens at -inf. `unsuppressed` [R, V]: the guided
    rows before min_tokens took their stop tokens away, for a row whose grammar allows nothing else."""
    forbidden = ~masks.allowed.to(logits.device)  # [R, V]
    sub = logits[masks.rows].masked_fill_(forbidden, float("-inf"))
    if unsuppressed is not None:
        empty = sub.isneginf().all(dim=1).nonzero()[:, 0]
        if len(empty):
            sub[empty] = unsuppressed[empty].masked_fill_(forbidden[empty], float("-inf"))
    logits[masks.rows] = sub


def finish(raw_logits: torch.Tensor, token_ids: list[int], params: list, broken: list[int]) -> SamplerOutput:
    """The step's output: tokens and logprobs, and NON_FINITE_LOGITS for the `broken` rows."""
    num_top = [None if i in broken else p.logprobs for i, p in enumerate(params)]
    errors = [NON_FINITE_LOGITS if i in broken else None for i in range(len(params))] if broken else []
    return SamplerOutput(token_ids, compute_logprobs(raw_logits, token_ids, num_top), errors)


def draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[B, V] probabilities (unnormalized, each row with some mass), [B] uniform numbers in [0, 1) -> [B]
    int64: the first token whose cumulative mass exceeds the row's draw. The draw is kept strictly below
    the row's total (u x total can round up to it), so a zero-mass tail token is never chosen."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniform[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    # right=True: the first token whose cumulative mass exceeds the draw, never a zero-mass one.
    return torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[1] - 1)[:, 0]


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


# `topk` of a few thousand out of 49,152 costs well under a millisecond against ~11 ms for a sort (one
# core); past a sixth of the vocabulary it costs most of a sort. A step's nucleus rarely holds more than
# a few hundred tokens, so top-p starts with this many candidates.
TOP_P_FIRST_CANDIDATES = 256
TOPK_MAX_FRACTION = 6  # wider than vocab / 6: sort in full


def apply_top_k_(logits: torch.Tensor, rows: list[int], top_k: list[int]) -> None:
    """In place on logits [B, V]: row rows[j] keeps its top_k[j] largest logits (ties at the k-th value
    are kept), each 0 < k < V, rows ascending. The k-th largest value is the same whether `topk` or a sort
    finds it."""
    every_row = len(rows) == logits.shape[0]
    index = torch.tensor(rows, device=logits.device)
    sub = logits if every_row else logits[index]  # [R, V]
    widest = max(top_k)
    if widest * TOPK_MAX_FRACTION <= logits.shape[1]:
        largest = sub.topk(widest, dim=-1).values  # [R, widest] descending
    else:
        largest = sub.sort(dim=-1, descending=True).values
    kth = largest.gather(1, torch.tensor(top_k, device=logits.device)[:, None] - 1)  # [R, 1]
    sub.masked_fill_(sub < kth, float("-inf"))
    if not every_row:
        logits[index] = sub


def apply_top_p_(probs: torch.Tensor, rows: list[int], top_p: list[float]) -> None:
    """In place on probs [B, V]: row rows[j] keeps the smallest set of most likely tokens whose mass
    reaches top_p[j] (always at least one) and zeroes the rest; rows ascending.

    With the row sorted in descending order, token i is dropped when the mass before it, cumsum[i] - p[i],
    is >= top_p. That mass never decreases along the sorted row (cumsum[j] >= cumsum[i] and p[j] <= p[i]
    for j > i, and rounding is monotone), so once a candidate is dropped every later token is too, and the
    candidates' prefix sums are the full sort's (a cumulative sum's prefix does not depend on what
    follows). A row is settled from its candidates when its first dropped candidate, the cut, lies
    before the candidates' smallest value (any `topk` picks the same tokens above it) and is strictly
    smaller than the last kept one (no tie across the cut, whose order a full sort would decide).
    A row whose candidates fall short tries again with more, or is sorted in full."""
    device = probs.device
    every_row = len(rows) == probs.shape[0]
    index = torch.tensor(rows, device=device)
    sub = probs if every_row else probs[index]  # [R, V]
    threshold = torch.tensor(top_p, dtype=probs.dtype, device=device)  # [R]
    vocab = sub.shape[1]
    pending = torch.arange(len(rows), device=device)  # rows of `sub` still to try with candidates
    tied = []  # rows with equal probabilities across the cut: only a full sort orders those
    width = TOP_P_FIRST_CANDIDATES
    while len(pending) and width * TOPK_MAX_FRACTION <= vocab:
        values, order = (sub if len(pending) == len(sub) else sub[pending]).topk(width, dim=-1)  # [P, width]
        mass = values.cumsum(dim=-1)
        mass_before = mass - values
        drop = mass_before >= threshold[pending, None]
        drop[:, 0] = False  # the most likely token stays, however small top_p is
        cut = drop.int().argmax(dim=1)  # [P] first dropped candidate (0 where none is)
        smallest_from = (values == values[:, -1:]).int().argmax(dim=1)  # first candidate of the smallest value
        reached = drop.any(dim=1) & (cut >= 1) & (cut <= smallest_from)
        untied = values.gather(1, (cut - 1).clamp(min=0)[:, None])[:, 0] > values.gather(1, cut[:, None])[:, 0]
        settled = reached & untied
        if settled.any():  # zero the rows, then put back the kept candidates
            kept = values[settled].masked_fill(torch.arange(width, device=device) >= cut[settled, None], 0.0)
            settled_rows = pending[settled]
            sub.index_fill_(0, settled_rows, 0.0)
            sub[settled_rows[:, None], order[settled]] = kept
        tied.append(pending[reached & ~untied])
        # Every token past the candidates is at most as likely as the smallest one, so a row short of
        # its mass needs at least (top_p - mass) / smallest more: try twice that many next.
        short = ~reached
        if short.any():
            needed = (threshold[pending[short]] - mass[short, -1]) / values[short, -1].clamp(min=1e-30)
            width = 1 << max(width, int(2 * (width + needed.max().clamp(max=vocab).item()))).bit_length()
        pending = pending[short]
    pending = torch.cat([pending, *tied])
    if len(pending):  # the full sort
        full = sub[pending]
        sorted_probs, order = full.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= threshold[pending, None]
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        sub[pending] = full.masked_fill(drop, 0.0)
    if not every_row:
        probs[index] = sub


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the row's most likely token."""
    threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
    return probs.masked_fill(probs < threshold, 0.0)


def compute_logprobs(
    logits: torch.Tensor, token_ids: list[int], num_top: list[int | None], ranks: bool = False
) -> list[TokenLogprobs | None]:
    """Log-probabilities under the model's own distribution (before sampling filters), finite: the logits
    are clamped to float32's range first, and a token far below the rest gets float32's lowest value, not
    -inf (which JSON cannot carry). `ranks`: each chosen token's rank too."""
    if all(k is None for k in num_top):
        return [None] * len(token_ids)
    rows = [i for i, k in enumerate(num_top) if k is not None]
    # Every row (a scored prompt's): clamped into a new tensor, without first gathering a copy.
    finite = (logits.clamp(-FLOAT32_MAX, FLOAT32_MAX) if len(rows) == logits.shape[0]
              else logits[rows].clamp_(-FLOAT32_MAX, FLOAT32_MAX))
    logprobs = torch.log_softmax(finite, dim=-1).clamp_(min=-FLOAT32_MAX)
    widest = max(1, min(max(num_top[i] for i in rows), logits.shape[1]))
    top_values, top_ids = top_by_value_then_id(logprobs, widest)
    chosen = logprobs.gather(1, torch.tensor([[token_ids[i]] for i in rows], device=logits.device))
    # int32 sums: 0.6x the time of the default int64 ones over [rows, vocab].
    rank = ((logprobs > chosen).sum(dim=1, dtype=torch.int32) + 1).tolist() if ranks else [None] * len(rows)
    result: list[TokenLogprobs | None] = [None] * len(token_ids)
    for j, i in enumerate(rows):
        k = num_top[i]
        top = tuple(zip(top_ids[j, :k].tolist(), top_values[j, :k].tolist()))
        result[i] = TokenLogprobs(token_ids[i], float(chosen[j, 0]), top, rank[j])
    return result


def top_by_value_then_id(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, V] -> the k largest values of each row and their indices [R, k], equal values in index order.
    `topk` orders ties as its batch happens to run them; a row with a tie among its best k + 1 is sorted
    stably instead, so a request's top logprobs do not depend on its batch."""
    wider = min(k + 1, values.shape[1])
    top_values, top_ids = values.topk(wider, dim=-1)  # [R, wider] descending
    tied = (top_values[:, 1:] == top_values[:, :-1]).any(dim=1).nonzero()[:, 0]
    if len(tied):
        top_values, top_ids = top_values.clone(), top_ids.clone()
        stable_values, stable_ids = values[tied].sort(dim=-1, descending=True, stable=True)
        top_values[tied], top_ids[tied] = stable_values[:, :wider], stable_ids[:, :wider]
    return top_values[:, :k], top_ids[:, :k]
