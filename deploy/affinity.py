"""Which replicas have recently served each prompt prefix: the router's memory, plain Python without Ray."""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple


class Match(NamedTuple):
    replica_ids: tuple[str, ...]  # live replicas holding the longest run of leading blocks; () when none
    num_blocks: int  # how many leading blocks they hold


class AffinityTable:
    """(block hash, replica) pairs: that replica served a prompt starting with those blocks, so its prefix
    cache holds them. A prefix served by several replicas (one spilled over when its first replica was
    busy) is held by each of them.

    Least recently used pairs go first beyond `capacity`, as the replicas' own prefix caches evict.
    """

    def __init__(self, capacity: int = 1 << 16) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._recent: OrderedDict[tuple[int, str], None] = OrderedDict()  # least recently used first
        self._owners: dict[int, set[str]] = {}
        self._num_blocks: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._recent)

    def num_blocks(self, replica_id: str) -> int:
        return self._num_blocks.get(replica_id, 0)

    def lookup(self, hashes: tuple[int, ...], live: set[str]) -> Match:
        """The live replicas holding the longest run of leading blocks (hashes chain, so holding block i
        means having served blocks 0..i as well)."""
        for index in range(len(hashes) - 1, -1, -1):
            owners = self._owners.get(hashes[index], set()) & live
            if owners:
                return Match(tuple(sorted(owners)), index + 1)
        return Match((), 0)

    def record(self, hashes: tuple[int, ...], replica_id: str) -> None:
        for block_hash in hashes:
            key = (block_hash, replica_id)
            if key in self._recent:
                self._recent.move_to_end(key)
            else:
                self._recent[key] = None
                self._owners.setdefault(block_hash, set()).add(replica_id)
                self._num_blocks[replica_id] = self._num_blocks.get(replica_id, 0) + 1
        while len(self._recent) > self.capacity:
            self._drop(next(iter(self._recent)))

    def forget(self, replica_id: str) -> None:
        """Drop a dead replica's entries: its cache died with it."""
        for key in [key for key in self._recent if key[1] == replica_id]:
            self._drop(key)
        self._num_blocks.pop(replica_id, None)

    def _drop(self, key: tuple[int, str]) -> None:
        block_hash, replica_id = key
        del self._recent[key]
        owners = self._owners[block_hash]
        owners.discard(replica_id)
        if not owners:
            del self._owners[block_hash]
        self._num_blocks[replica_id] -= 1
