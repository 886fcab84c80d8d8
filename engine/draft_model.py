"""Drafts from a draft model: a smaller model of the same vocabulary decodes k greedy tokens ahead.

The draft model keeps a paged KV cache of its own, with a shadow of each speculating request in its own
block manager (no prefix cache). Each step it first catches up on the tokens the request gained since it
last ran (the whole prompt the first time; after that the accepted drafts and the verified token), one
chunk per request in one step, whose last row gives the first draft; then one batched decode step per
further draft. What it computed for drafts the target kept stays valid: after a verify step of k drafts
with a kept, its cache holds the sequence up to the last kept one (`record`).

Drafts are the draft model's argmax, a point mass, so `Sampler.verify` keeps each with the target's
probability of it and sampled text keeps the target's distribution; greedy text is the target's own.
When the draft cache is full, the shadows of requests not speculating this step are dropped (they
compute their prompt again if they speculate later); a request that still finds no blocks does not
speculate this step.
"""

from __future__ import annotations

import torch

from engine.block_manager import KVBlockManager
from engine.request import Request
from engine.sampler import argmax_rows
from engine.sampling_params import SamplingParams
from engine.speculative import Proposer
from kernels.kv_layout import blocks_for_tokens
from model.loader import LoadedModel
from model.step import SeqChunk, build_step, run_step


class DraftModelProposer(Proposer):
    def __init__(self, draft: LoadedModel, vocab_size: int, max_model_len: int, default_tokens: int = 4,
                 max_batch: int = 4) -> None:
        super().__init__(default_tokens, max_batch)
        if draft.config.vocab_size != vocab_size:
            raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size} tokens) is not the served "
                             f"model's ({vocab_size}); a draft model must share its tokenizer")
        if draft.config.linear_layers:  # its states could not take back the drafts the served model rejects
            raise ValueError(f"a draft model with linear-attention layers ({draft.config.architecture}) is not "
                             "supported: its states cannot take back rejected drafts")
        self.module = draft.module
        block_size = self.module.block_size
        # Room for max_batch sequences at full length: the ones speculating at once.
        num_blocks = blocks_for_tokens(max_model_len, block_size) * max_batch
        self.blocks = KVBlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.kv_caches = self.module.allocate_kv_caches(num_blocks)
        self.shadows: dict[str, Request] = {}  # request id -> its tokens' place in the draft cache

    @torch.inference_mode()
    def draft(self, widths: dict[Request, int]) -> dict[Request, list[int]]:
        chunks: dict[Request, list[int]] = {}
        for request, k in widths.items():
            shadow = self._shadow(request)
            new = request.all_token_ids[shadow.num_computed_tokens:]
            # Blocks for the catch-up chunk and the k - 1 drafts computed after it.
            if not self._allocate(shadow, len(new) + k - 1, widths):
                continue
            chunks[request] = new
        drafts: dict[Request, list[int]] = {request: [] for request in chunks}
        step = [(request, tokens) for request, tokens in chunks.items()]
        while step:
            seq_chunks = [SeqChunk(tokens, self.shadows[r.request_id].num_computed_tokens,
                                   self.shadows[r.request_id].block_ids) for r, tokens in step]
            logits = run_step(self.module, build_step(seq_chunks, self.module.block_size, self.module.device),
                              self.kv_caches)
            chosen = argmax_rows(logits.float()).tolist()
            following = []
            for (request, tokens), token in zip(step, chosen):
                self.shadows[request.request_id].num_computed_tokens += len(tokens)
                drafts[request].append(token)
                if len(drafts[request]) < widths[request]:
                    following.append((request, [token]))
            step = following
        return drafts

    def record(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        super().record(request, num_proposed, num_accepted)
        shadow = self.shadows.get(request.request_id)
        if shadow is not None:
            # The cache holds the sequence's tokens (request.num_tokens, the step's not yet appended) and
            # drafts 1..k-1 after them; of those, the kept drafts stay true.
            shadow.num_computed_tokens = request.num_tokens + min(num_accepted, num_proposed - 1)

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        shadow = self.shadows.pop(request_id, None)
        if shadow is not None:
            self.blocks.release(shadow)

    def close(self) -> None:
        self.module.close()

    def _shadow(self, request: Request) -> Request:
        shadow = self.shadows.get(request.request_id)
        if shadow is None:
            shadow = self.shadows[request.request_id] = Request(request.request_id, [], SamplingParams())
        # At least the last token runs: its row gives the first draft. This also drops what drafts left in
        # the cache when a step dropped them (the request then decoded one token, the drafts' first place).
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, request.num_tokens - 1)
        return shadow

    def _allocate(self, shadow: Request, num_new: int, speculating: dict[Request, int]) -> bool:
        if self.blocks.allocate(shadow, num_new):
            return True
        keep = {r.request_id for r in speculating}
        for request_id in [rid for rid in self.shadows if rid not in keep]:
            self.blocks.release(self.shadows.pop(request_id))
        return self.blocks.allocate(shadow, num_new)
