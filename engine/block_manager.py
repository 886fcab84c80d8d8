"""KV-cache block bookkeeping with prefix caching. Pure Python: no tensors, unit-tested without a model.

A block holds `block_size` consecutive tokens of one sequence. Blocks are reference counted so that
requests with a common prefix share them. A full block whose tokens are computed is registered under a
chained sha256 of its tokens (the hash of the block before it, then its token ids), so equal hashes mean
equal whole prefixes. The chain starts from the request's `cache_salt`, its LoRA adapter's, so blocks
computed with one adapter are never found by a request with another (or with none); the block that holds
a prompt's first image token hashes the images' pixels too. When its last reference goes, a registered
block stays in the cache, free but reusable, until the allocator needs it: free blocks are handed out least
recently freed first.

The blocks may be split into equal pools (`num_pools`): pool p holds ids [p * n, (p + 1) * n). A request
takes every block from its own pool (`Request.kv_pool`, chosen when it is admitted), and the prefix cache
finds blocks in that pool only. Tensor parallelism by sequences keeps pool p's blocks on rank p alone
(parallel/layout.py), so a sequence's cache never spans ranks. One pool is the ordinary cache.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import NamedTuple

from engine.request import Request
from kernels.kv_layout import blocks_for_tokens


class CachedPrefix(NamedTuple):
    block_ids: list[int]
    num_tokens: int
    # The windowed layers' cached blocks the prefix's first query reads (engine/window_blocks.py); () else.
    window_block_ids: list[int] | tuple[int, ...] = ()


class KVBlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_pools: int = 1) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        if num_pools < 1 or num_blocks % num_pools:
            raise ValueError(f"{num_blocks} blocks do not split into {num_pools} equal pools")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_pools = num_pools
        self.pool_size = num_blocks // num_pools  # blocks per pool
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # Per pool: hash of a computed full block -> its block id.
        self.cached: list[dict[bytes, int]] = [{} for _ in range(num_pools)]
        # Per pool, blocks with no reference, oldest first; the allocator takes from the front.
        self.free: list[OrderedDict[int, None]] = [
            OrderedDict.fromkeys(range(p * self.pool_size, (p + 1) * self.pool_size)) for p in range(num_pools)]
        # Per request, how many of its leading full blocks `register_computed_blocks` has seen: each step then
        # looks at the blocks it completed, not at the whole context. (A block whose tokens were cached under
        # another block when it completed stays unregistered, even once that other block is evicted.)
        self.registered: dict[Request, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    @property
    def num_free_blocks(self) -> int:
        return sum(map(len, self.free))

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a request (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for_tokens(num_tokens, self.block_size)

    def pool_of(self, block: int) -> int:
        return block // self.pool_size

    def cached_prefix(self, request: Request, pool: int = 0) -> CachedPrefix:
        """The longest run of the request's leading full blocks already in the pool's cache (counted in
        no statistic: a pool chooser may ask every pool; `count_lookup` counts the admission's).

        At least one token is always left to compute, since sampling needs its logits. A request that
        scores its prompt (prompt_logprobs) or pools every row (an embedding's mean) needs every prompt row:
        none is read.
        """
        if not self.enable_prefix_caching or request.needs_every_prompt_row:
            return CachedPrefix([], 0)
        self._update_hashes(request)
        cached = self.cached[pool]
        hits: list[int] = []
        for block_hash in request.block_hashes:
            block = cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        if hits and len(hits) * self.block_size >= request.num_tokens:
            hits.pop()
        return CachedPrefix(hits, len(hits) * self.block_size)

    def count_lookup(self, request: Request, prefix: CachedPrefix) -> None:
        """Count one admission's lookup in the hit rate (prompt tokens asked, tokens found)."""
        if self.enable_prefix_caching:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += prefix.num_tokens

    def allocate(self, request: Request, num_new_tokens: int, prefix: CachedPrefix | None = None) -> bool:
        """Give the request blocks of its pool for `num_new_tokens` more tokens (after `prefix`, if
        admitting).

        Returns False, changing nothing, when there are not enough free blocks.
        """
        shared = prefix.block_ids if prefix else []
        num_tokens = request.num_computed_tokens + (prefix.num_tokens if prefix else 0) + num_new_tokens
        num_needed = self.blocks_needed(num_tokens) - len(request.block_ids) - len(shared)
        free = self.free[request.kv_pool]
        # Cached blocks with no reference sit in the free list; taking them shrinks it.
        num_shared_free = sum(1 for b in shared if self.ref_counts[b] == 0)
        if num_needed > len(free) - num_shared_free:
            return False
        for block in shared:
            if self.ref_counts[block] == 0:
                del free[block]
            self.ref_counts[block] += 1
        request.block_ids.extend(shared)
        for _ in range(max(num_needed, 0)):
            block, _ = free.popitem(last=False)
            self._forget(block)
            self.ref_counts[block] = 1
            request.block_ids.append(block)
        return True

    def register_computed_blocks(self, request: Request) -> None:
        """Put the request's newly computed full blocks into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        self._update_hashes(request)
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        done = self.registered.get(request, 0) if request.block_ids else 0
        for index in range(done, num_full):
            self._register(request, index)
        self.registered[request] = max(done, num_full)

    def _register(self, request: Request, index: int) -> None:
        """Put the request's computed full block `index` into the prefix cache (unless one like it is there)."""
        block = request.block_ids[index]
        block_hash = request.block_hashes[index]
        cached = self.cached[self.pool_of(block)]
        if self.block_hash[block] is None and block_hash not in cached:
            self.block_hash[block] = block_hash
            cached[block_hash] = block

    def release(self, request: Request) -> None:
        """Drop the request's references. Its last blocks are freed first so they are evicted first:
        the prefix, shared more often, stays cached longer."""
        self.registered.pop(request, None)
        for block in reversed(request.block_ids):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[self.pool_of(block)][block] = None
        request.block_ids = []

    def _forget(self, block: int) -> None:
        block_hash = self.block_hash[block]
        if block_hash is not None:
            self.block_hash[block] = None
            cached = self.cached[self.pool_of(block)]
            if cached.get(block_hash) == block:
                del cached[block_hash]

    def _update_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        if len(hashes) >= request.num_tokens // self.block_size:
            return  # no new full block (and no copy of the whole token list to find that out)
        tokens = request.all_token_ids
        # The block of the first image token is keyed by the images' pixels too (the chain carries them to
        # every block after it); the blocks before it are text alone, shared with any request.
        first_image = request.image_positions[0] // self.block_size if request.image_positions else -1
        for index in range(len(hashes), len(tokens) // self.block_size):
            chunk = tokens[index * self.block_size:(index + 1) * self.block_size]
            parent = hashes[-1] if hashes else request.cache_salt
            images = request.image_digest if index == first_image else b""
            hashes.append(hashlib.sha256(parent + images + array("q", chunk).tobytes()).digest())
