"""All-reduce through shared memory, for the ranks of one host's CPU tensor-parallel group.

gloo sends every all-reduce through loopback TCP, a fixed cost per call that a step of the default model
pays 61 to 121 times (two per layer, and W8A8's scale maxima). Ranks on one host can instead share one
mapped file:

- the region is a header of per-rank arrival counters (one cache line each) and an abort flag, then two
  sets of `size` slots of `capacity` 4-byte elements each (float32, or int32 for exact integer sums);
- call g (counting from 1 on every rank) copies the rank's tensor into its slot of set g % 2, publishes
  `arrived[rank] = g` (release), waits until every rank has published g (acquire), and then every rank
  sums (or takes the maximum of) the slots in rank order, so all ranks hold bit-identical results (a
  gather is the same call without the sum: rank 0 reads every slot);
- two sets make one barrier per call enough: a rank that writes set (g+1) % 2 has passed barrier g, so
  every rank has finished reading that set's previous use, call g-1.

A peer that stops never hangs a rank: the wait gives up when the group's abort flag is set (rank 0's
monitor sets it when a worker dies), when the rank's parent is gone (a worker whose rank 0 died), or after
the group's timeout. Tensors larger than a slot go through in slot-sized pieces. The C++ side is
kernels/csrc/shared_memory_all_reduce.cpp, in the one CPU extension (kernels/cpu_extension.py).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from kernels.cpu_extension import load

HEADER_BYTES = 64 * 64  # 63 arrival counters and the abort flag, one cache line each
MAX_RANKS = 63
DEFAULT_CAPACITY = 1 << 20  # float32 per slot (4 MiB): a 2,048-token step of a 512-wide model in one piece


def available() -> bool:
    """Whether the C++ side is built here (and not switched off by LADDER_CPU_KERNELS=0)."""
    return load() is not None


def region_bytes(size: int, capacity: int) -> int:
    return HEADER_BYTES + 2 * size * capacity * 4


def create_region(size: int, capacity: int = DEFAULT_CAPACITY) -> Path:
    """A zeroed file for the group's region, in /dev/shm where there is one; rank 0 removes it once every
    rank has mapped it (the mappings outlive the name)."""
    if not 2 <= size <= MAX_RANKS:
        raise ValueError(f"a shared-memory group holds 2 to {MAX_RANKS} ranks, not {size}")
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, name = tempfile.mkstemp(prefix="ladder-tp-", dir=directory)
    try:
        os.ftruncate(fd, region_bytes(size, capacity))
    finally:
        os.close(fd)
    return Path(name)


class SharedMemoryAllReduce:
    def __init__(self, path: Path, rank: int, size: int, timeout_s: float, parent_pid: int = 0,
                 capacity: int = DEFAULT_CAPACITY) -> None:
        self.module = load()
        if self.module is None:
            raise RuntimeError("the shared-memory all-reduce could not be built here")
        self.region = torch.from_file(str(path), shared=True, size=region_bytes(size, capacity), dtype=torch.uint8)
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.parent_pid = parent_pid  # a worker's rank 0: waiting stops when it is gone (0: do not watch)
        self.capacity = capacity
        self.calls = 0

    def supports(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in (torch.float32, torch.int32) and x.is_contiguous()

    def __call__(self, x: torch.Tensor, take_max: bool = False) -> torch.Tensor:
        """Reduce contiguous float32 or int32 `x` over the ranks in place (sum, or the maximum); returns it."""
        if x.numel() <= self.capacity:  # one piece: the common case, kept free of Python work
            self.calls += 1
            self.module.all_reduce(x, self.region, self.rank, self.size, self.calls, self.capacity, take_max,
                                   self.timeout_s, self.parent_pid)
            return x
        flat = x.view(-1)
        for start in range(0, flat.numel(), self.capacity):
            self.calls += 1
            self.module.all_reduce(flat[start:start + self.capacity], self.region, self.rank, self.size, self.calls,
                                   self.capacity, take_max, self.timeout_s, self.parent_pid)
        return x

    def supports_gather(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous()

    def gather_columns(self, x: torch.Tensor, widths: list[int], everywhere: bool = False) -> torch.Tensor | None:
        """Rank r's contiguous float32 x [N, widths[r]] -> on rank 0 (on every rank if `everywhere`) the
        parts side by side, [N, sum(widths)]; None on the others. Rows go in slot-sized pieces; every rank
        waits for all, so the ranks stay in step call by call as in an all-reduce."""
        rows = x.shape[0]
        widest = max(widths)
        if widest > self.capacity:
            raise ValueError(f"a row of {widest} floats does not fit a slot of {self.capacity}")
        per_piece = self.capacity // max(widest, 1)
        out = x.new_empty(rows, sum(widths)) if self.rank == 0 or everywhere else None
        for start in range(0, max(rows, 1), per_piece):
            self.calls += 1
            self.module.gather_columns(x[start:start + per_piece], None if out is None else out[start:start + per_piece],
                                       self.region, self.rank, self.size, self.calls, self.capacity, widths,
                                       self.timeout_s, self.parent_pid)
        return out

    def abort(self) -> None:
        """Make every rank's waiting all-reduce fail now (the group has lost a rank)."""
        self.module.set_abort(self.region)

