"""The collectives a tensor-parallel step runs, timed on the calling rank.

Each op is a blocking torch.distributed call (gloo on a CPU, NCCL on CUDA) on the default group, whose
timeout bounds how long a rank waits for a peer that stopped. The time a rank spends in an op is the
transfer plus the wait for the slowest peer to arrive: on rank 0 that is the communication part of a
step as the engine sees it. (On CUDA an NCCL call returns once queued, so the host time counts only
what the stream had to finish first.)
"""

from __future__ import annotations

import time
from collections import Counter

import torch
import torch.distributed as dist


class Collectives:
    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size
        self.seconds: Counter = Counter()  # op -> seconds spent in it on this rank, since start
        self.calls: Counter = Counter()

    def _timed(self, op: str, started: float) -> None:
        self.seconds[op] += time.perf_counter() - started
        self.calls[op] += 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks in place; returns it."""
        started = time.perf_counter()
        dist.all_reduce(x)
        self._timed("all_reduce", started)
        return x

    def gather_columns(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """Rank r's x [N, widths[r]] (padded to max(widths) columns by the caller) -> on rank 0 the
        concatenation [N, sum(widths)]; on the other ranks x itself (they have no use for the result)."""
        started = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x.contiguous(), parts, dst=0)
        self._timed("gather", started)
        if parts is None:
            return x
        return torch.cat([part[:, :width] for part, width in zip(parts, widths)], dim=1)

    def record(self, op: str, started: float) -> None:
        """Time spent in an op that runs outside torch.distributed (the step broadcast over pipes)."""
        self._timed(op, started)
