"""The prefix cache of a model with linear-attention layers (Qwen3.5): their states at block boundaries.

The attention layers' KV blocks are cached by prefix as for any model (engine/block_manager.py). A linear-attention
layer's state, though, holds every token before it and cannot be cut back, so a cached prefix is usable only up to
a block boundary where a copy of the states was kept: a snapshot, in a row of the same pools as the running
sequences' states (rows `first_slot` on; engine/state_slots.py has the rows before them).

A prompt's states are kept at two boundaries (`boundaries`): the last one before its last token (`checkpoint`),
which the next turn of a chat starts from (its prompt holds the previous one's), and the end of the longest prefix
its KV blocks share with earlier prompts when that reaches past every snapshot (a long system prompt and tools that
conversations share: the second such conversation keeps the snapshot the ones after it start from). The scheduler
ends a prompt's chunk at each, and after that step the engine copies the sequence's states into a snapshot
registered under the hash of the prefix's last block. Snapshots are evicted least recently used first. Pure
Python: the copies are the model runner's (engine/model_runner.py `copy_states`).
"""

from __future__ import annotations

from collections import OrderedDict

from engine.request import Request


def checkpoint(num_prompt_tokens: int, block_size: int) -> int:
    """The block boundary a prompt's states are kept at: the last one before its last token (0: none), which a
    later prompt's cached prefix can reach (the block manager always leaves a token to compute)."""
    return (num_prompt_tokens - 1) // block_size * block_size


def boundaries(request: Request, block_size: int) -> tuple[int, ...]:
    """The positions a request's states are kept at (ascending; none at 0): its shared prefix's end and its
    prompt's checkpoint."""
    return tuple(sorted({b for b in (request.shared_prefix, checkpoint(request.num_prompt_tokens, block_size)) if b}))


class StateCache:
    def __init__(self, first_slot: int, num_snapshots: int) -> None:
        self.num_snapshots = num_snapshots
        self.free = list(range(first_slot + num_snapshots - 1, first_slot - 1, -1))  # the first row first
        self.cached: OrderedDict[bytes, int] = OrderedDict()  # prefix hash -> snapshot row, least recent first
        self.hits = 0  # admissions that started from a snapshot

    def find(self, block_hash: bytes) -> int | None:
        """The snapshot taken after the prefix ending with this block, if kept (now the most recently used)."""
        slot = self.cached.get(block_hash)
        if slot is not None:
            self.cached.move_to_end(block_hash)
        return slot

    def keep(self, block_hash: bytes) -> int | None:
        """A row for a new snapshot after the prefix ending with this block, registered under its hash: a free row,
        or the least recently used snapshot's. None when one is kept for that prefix already, or there are no
        rows."""
        if block_hash in self.cached or not self.num_snapshots:
            return None
        if self.free:
            slot = self.free.pop()
        else:
            _, slot = self.cached.popitem(last=False)
        self.cached[block_hash] = slot
        return slot
