"""The collectives a tensor-parallel step runs, timed on the calling rank.

Each op is a blocking call on the group's own process group (gloo on a CPU, NCCL on CUDA), not on
torch.distributed's global default group, so one process may hold several groups one after another (or
at once) and a program that uses torch.distributed itself is left alone. CPU ranks all-reduce and gather
through the group's shared-memory region instead when it has one (parallel/shared_memory_all_reduce.py).
The group's timeout bounds how long a rank waits for a peer that stopped. The time a rank spends in an
op is the transfer plus the wait for the slowest peer to arrive: on rank 0 that is the communication part
of a step as the engine sees it. (On CUDA an NCCL call returns once queued, so the host time counts only
what the stream had to finish first.)
"""

from __future__ import annotations

import time
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from parallel.shared_memory_all_reduce import SharedMemoryAllReduce


def create_group(backend: str, store: dist.Store, rank: int, size: int, timeout_s: float) -> dist.ProcessGroup:
    """A process group of `size` ranks met through `store` (returns once every rank has joined)."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def padded(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [N, w <= width] -> contiguous [N, width], zeros on the right."""
    return nn.functional.pad(x, (0, width - x.shape[1])).contiguous() if x.shape[1] < width else x.contiguous()


def side_by_side(parts: list[torch.Tensor], widths: list[int]) -> torch.Tensor:
    """Rank r's part [N, max(widths)], padded, -> its first widths[r] columns, all ranks side by side."""
    return torch.cat([part[:, :width] for part, width in zip(parts, widths)], dim=1)


class Collectives:
    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int,
                 shared: SharedMemoryAllReduce | None = None) -> None:
        self.group = group
        self.rank = rank
        self.size = size
        self.shared = shared  # CPU ranks of one host: all-reduces through shared memory, not gloo's TCP
        self.seconds: Counter = Counter()  # op -> seconds spent in it on this rank, since start
        self.calls: Counter = Counter()

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def _timed(self, op: str, started: float) -> None:
        self.seconds[op] += time.perf_counter() - started
        self.calls[op] += 1

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sum (or, op "max", the maximum of) `x` over the ranks in place; returns it."""
        started = time.perf_counter()
        if self.shared is not None and self.shared.supports(x):
            self.shared(x, take_max=op == "max")
        else:
            options = dist.AllreduceOptions()
            options.reduceOp = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
            self.group.allreduce([x], options).wait()
        self._timed("all_reduce" if op == "sum" else f"all_reduce_{op}", started)
        return x

    def gather_columns(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """Rank r's x [N, widths[r]] -> on rank 0 the concatenation [N, sum(widths)]; on the other ranks
        x itself (they have no use for the result)."""
        started = time.perf_counter()
        if self.shared is not None and self.shared.supports_gather(x):
            gathered = self.shared.gather_columns(x, widths)
            self._timed("gather", started)
            return x if gathered is None else gathered
        x = padded(x, max(widths))  # gloo moves equal shapes
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else []
        options = dist.GatherOptions()
        options.rootRank = 0
        self.group.gather([parts] if parts else [], [x], options).wait()
        self._timed("gather", started)
        if not parts:
            return x
        return side_by_side(parts, widths)

    def all_gather_columns(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """Rank r's x [N, widths[r]] -> on every rank the concatenation [N, sum(widths)]."""
        started = time.perf_counter()
        if self.shared is not None and self.shared.supports_gather(x):
            gathered = self.shared.gather_columns(x, widths, everywhere=True)
        else:
            x = padded(x, max(widths))
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self.group.allgather([parts], [x]).wait()
            gathered = side_by_side(parts, widths)
        self._timed("all_gather", started)
        return gathered

    def all_gather_rows(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rank r's x [counts[r], W] -> on every rank the ranks' rows one after another, [sum(counts), W]."""
        width = x.shape[1]
        total = sum(counts)
        if self.shared is not None and self.shared.supports_gather(x) and max(counts) * width <= self.shared.capacity:
            # Rows are contiguous: rank-major rows are one flat run of each rank's elements.
            flat = self.all_gather_columns(x.reshape(1, -1), [count * width for count in counts])
            return flat.view(total, width)
        # Larger parts (a long prefill on one rank) go as columns of the transpose, in row pieces.
        return self.all_gather_columns(x.t().contiguous(), counts).t().contiguous()

    def send(self, x: torch.Tensor, rank: int) -> None:
        self.group.send([x.contiguous()], rank, 0).wait()

    def receive(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        self.group.recv([x], rank, 0).wait()
        return x

    def shutdown(self) -> None:
        """Leave the group and let it go now, in this thread (its store with it): left to interpreter exit,
        their threads can be torn down out of order, and the process ends with "terminate called without
        an active exception". No collective runs after this."""
        group, self.group = self.group, None
        if group is None:
            return
        try:
            group.shutdown()
        except Exception:  # a group whose peers are gone: nothing left to close cleanly
            pass
        del group  # the last reference: destroyed here

    def abort(self) -> None:
        """The group lost a rank: make any all-reduce waiting in shared memory fail now, on every rank (a
        gloo call fails by itself when its peer's connection closes)."""
        if self.shared is not None:
            self.shared.abort()

    def record(self, op: str, started: float) -> None:
        """Time spent in an op that runs outside torch.distributed (the step broadcast over pipes)."""
        self._timed(op, started)
