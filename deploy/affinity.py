"""Which replica last served each prompt prefix: the router's memory, plain Python without Ray."""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple


class Match(NamedTuple):
    replica_id: str | None  # None: no live replica has served any of these blocks
    num_blocks: int  # leading blocks that replica has served


class AffinityTable:
    """Block hash -> the replica that most recently served a prompt starting with those blocks.

    Least recently used entries go first beyond `capacity`, as the replicas' own prefix caches evict.
    """

    def __init__(self, capacity: int = 1 << 16) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._owners: OrderedDict[int, str] = OrderedDict()
        self._num_blocks: dict[str, int] = {}  # replica -> entries it owns

    def num_blocks(self, replica_id: str) -> int:
        return self._num_blocks.get(replica_id, 0)

    def _set(self, block_hash: int, owner: str | None) -> None:
        previous = self._owners.pop(block_hash, None)
        if previous is not None:
            self._num_blocks[previous] -= 1
        if owner is not None:
            self._owners[block_hash] = owner
            self._num_blocks[owner] = self._num_blocks.get(owner, 0) + 1

    def __len__(self) -> int:
        return len(self._owners)

    def lookup(self, hashes: tuple[int, ...], live: set[str]) -> Match:
        """The live replica holding the longest run of leading blocks (hashes chain, so the longest
        known hash implies all before it)."""
        for index in range(len(hashes) - 1, -1, -1):
            owner = self._owners.get(hashes[index])
            if owner is not None and owner in live:
                return Match(owner, index + 1)
        return Match(None, 0)

    def record(self, hashes: tuple[int, ...], replica_id: str) -> None:
        for block_hash in hashes:
            self._set(block_hash, replica_id)  # re-inserted last: the most recently used
        while len(self._owners) > self.capacity:
            self._set(next(iter(self._owners)), None)

    def forget(self, replica_id: str) -> None:
        """Drop a dead replica's entries: its cache died with it."""
        for block_hash in [h for h, owner in self._owners.items() if owner == replica_id]:
            self._set(block_hash, None)
        self._num_blocks.pop(replica_id, None)
