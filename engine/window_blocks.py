"""KV blocks for a model whose sliding-window layers keep only their window (Gemma 3: 15 of 18 layers).

A block id of the ordinary manager (engine/block_manager.py) names a block in every layer's cache, so a
windowed layer would hold a sequence's whole context although it only ever reads the last `window` keys.
Here the windowed layers have a cache of their own, with its own block ids: a request holds, beside its
`block_ids` for the full-attention layers, `window_block_ids` for the windowed ones, one entry per block
of the sequence, and gives back each windowed block once no query can see it again. Block i holds
positions [i * bs, (i + 1) * bs); the queries of a step start at position p = num_computed_tokens and see
keys from p - window + 1 on, so every block with (i + 1) * bs <= p - window + 1 is dropped (its entry
becomes DROPPED). The model's attention reads nothing below a query's window, so the dropped entries of
the table it gets are placeholders (model/step.py).

Prefix caching covers both: a windowed block is registered under the same chained hash as the full block
of the same tokens, and stays cached after it is dropped or released until the allocator needs it. A
request may reuse a cached prefix of P tokens only if the windowed blocks its first query reads, those of
positions [P - window + 1, P), are cached too: otherwise the prefix is shortened, block by block, until
they are (down to none).

One pool only: tensor parallelism, whose ranks take each step's block tables over a pipe, keeps the shared
tables.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.block_manager import CachedPrefix, KVBlockManager
from engine.request import Request

DROPPED = -1  # a window_block_ids entry whose block was given back (out of every later query's window)


class WindowedBlockManager(KVBlockManager):
    """The full-attention layers' blocks (the base class) and the windowed layers' `num_window_blocks`."""

    def __init__(self, num_blocks: int, num_window_blocks: int, block_size: int, window: int,
                 enable_prefix_caching: bool = True) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        if num_window_blocks < 1 or window < 1:
            raise ValueError(f"need a window and window blocks, got {window} tokens, {num_window_blocks} blocks")
        self.window = window
        self.num_window_blocks = num_window_blocks
        self.window_refs = [0] * num_window_blocks
        self.window_hash: list[bytes | None] = [None] * num_window_blocks
        self.window_cached: dict[bytes, int] = {}
        self.window_free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_window_blocks))
        # Per request, how many of its leading entries are DROPPED already: each step then looks at the blocks
        # that just left the window, not at the whole context.
        self.dropped: dict[Request, int] = {}

    @property
    def num_free_window_blocks(self) -> int:
        return len(self.window_free)

    def first_visible_block(self, position: int) -> int:
        """The lowest block a query at `position` (or later) reads in a windowed layer."""
        return max(0, position - self.window + 1) // self.block_size

    def cached_prefix(self, request: Request, pool: int = 0) -> CachedPrefix:
        prefix = super().cached_prefix(request, pool)
        for num_blocks in range(len(prefix.block_ids), 0, -1):
            first = self.first_visible_block(num_blocks * self.block_size)
            window = [self.window_cached.get(h) for h in request.block_hashes[first:num_blocks]]
            if None not in window:
                return CachedPrefix(prefix.block_ids[:num_blocks], num_blocks * self.block_size, window)
        return CachedPrefix([], 0)

    def allocate(self, request: Request, num_new_tokens: int, prefix: CachedPrefix | None = None) -> bool:
        """The base class's blocks, and windowed blocks for every block from the first one the step's queries
        see to the last one its tokens reach; both or neither (False, nothing but the dropping changed)."""
        start = request.num_computed_tokens + (prefix.num_tokens if prefix else 0)
        first_visible = self.first_visible_block(start)
        self._drop_unseen(request, first_visible)
        held = request.window_block_ids
        shared = list(prefix.window_block_ids) if prefix else []
        # An admission with a cached prefix holds nothing yet: its entries will be DROPPED up to the first
        # visible block, then the shared blocks (up to the prefix's end), then fresh ones.
        reached = first_visible + len(shared) if shared else len(held)
        end_block = self.blocks_needed(start + num_new_tokens)
        num_fresh = max(end_block - reached, 0)
        num_shared_free = sum(1 for b in shared if self.window_refs[b] == 0)
        if num_fresh > len(self.window_free) - num_shared_free:
            return False
        if not super().allocate(request, num_new_tokens, prefix):
            return False
        if shared:
            held.extend([DROPPED] * (first_visible - len(held)))
            for block in shared:
                if self.window_refs[block] == 0:
                    del self.window_free[block]
                self.window_refs[block] += 1
                held.append(block)
        while len(held) < end_block:
            block, _ = self.window_free.popitem(last=False)
            self._forget_window(block)
            self.window_refs[block] = 1
            held.append(block)
        return True

    def _register(self, request: Request, index: int) -> None:
        """The full-attention block's registration (the base class), and the windowed block of the same
        tokens under the same hash."""
        super()._register(request, index)
        if index >= len(request.window_block_ids):
            return
        block, block_hash = request.window_block_ids[index], request.block_hashes[index]
        if block != DROPPED and self.window_hash[block] is None and block_hash not in self.window_cached:
            self.window_hash[block] = block_hash
            self.window_cached[block_hash] = block

    def release(self, request: Request) -> None:
        super().release(request)
        for index in range(len(request.window_block_ids) - 1, self.dropped.pop(request, 0) - 1, -1):
            self._give_back(request, index)
        request.window_block_ids = []

    def _drop_unseen(self, request: Request, first_visible: int) -> None:
        done = self.dropped.get(request, 0)
        if not request.window_block_ids:
            done = 0  # a request that was preempted (its list emptied) starts again
        end = min(first_visible, len(request.window_block_ids))
        for index in range(done, end):
            self._give_back(request, index)
        self.dropped[request] = max(done, end)

    def _give_back(self, request: Request, index: int) -> None:
        block = request.window_block_ids[index]
        if block == DROPPED:
            return
        request.window_block_ids[index] = DROPPED
        self.window_refs[block] -= 1
        if self.window_refs[block] == 0:
            self.window_free[block] = None

    def _forget_window(self, block: int) -> None:
        block_hash = self.window_hash[block]
        if block_hash is not None:
            self.window_hash[block] = None
            if self.window_cached.get(block_hash) == block:
                del self.window_cached[block_hash]
