"""All-reduce through shared memory, for the ranks of one host's CPU tensor-parallel group.

gloo sends every all-reduce through loopback TCP: about 0.8 ms per call on this 2-core machine, and a step
of the default model makes 61 to 121 of them (two per layer, and W8A8's scale maxima), so communication
was two thirds of a 2-rank step. Ranks on one host can instead share one mapped file:

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
the group's timeout. Tensors larger than a slot go through in slot-sized pieces.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from kernels.cpu_extension import LazyExtension, cpu_kernels_enabled

HEADER_BYTES = 64 * 64  # 63 arrival counters and the abort flag, one cache line each
MAX_RANKS = 63
DEFAULT_CAPACITY = 1 << 20  # float32 per slot (4 MiB): a 2,048-token step of a 512-wide model in one piece

SOURCE = r"""
#include <torch/extension.h>
#include <atomic>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {
using Counter = std::atomic<uint64_t>;
constexpr int64_t kLine = 64;
constexpr int64_t kHeader = 64 * 64;
constexpr int64_t kAbortSlot = 63;

inline Counter* counter(uint8_t* region, int64_t index) { return reinterpret_cast<Counter*>(region + index * kLine); }

inline void relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// Wait until every rank has published `call`; throws when the group aborts, the parent dies or time runs out.
void wait_for_all(uint8_t* region, int64_t size, uint64_t call, double timeout_s, int64_t parent_pid) {
  const auto start = std::chrono::steady_clock::now();
  int64_t spins = 0;
  for (int64_t r = 0; r < size; ++r) {
    while (counter(region, r)->load(std::memory_order_acquire) < call) {
      if (++spins < 4096) { relax(); continue; }
      std::this_thread::yield();  // a rank that waits long gives its core to whoever it waits for
      if ((spins & 255) != 0) continue;
      if (counter(region, kAbortSlot)->load(std::memory_order_acquire) != 0)
        throw std::runtime_error("shared-memory all-reduce: the tensor-parallel group was aborted");
      if (parent_pid > 0 && getppid() != parent_pid)
        throw std::runtime_error("shared-memory all-reduce: rank 0 is gone");
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (waited > timeout_s)
        throw std::runtime_error("shared-memory all-reduce: rank " + std::to_string(r) + " did not arrive within " +
                                 std::to_string(static_cast<int64_t>(timeout_s)) + " s");
    }
  }
}
}  // namespace

template <typename T>
void reduce_slots(T* data, const T* slots, int64_t n, int64_t size, int64_t capacity, bool take_max) {
  std::memcpy(data, slots, n * sizeof(T));
  for (int64_t r = 1; r < size; ++r) {  // rank order on every rank: bit-identical results everywhere
    const T* other = slots + r * capacity;
    if (take_max) {
      for (int64_t i = 0; i < n; ++i) data[i] = data[i] < other[i] ? other[i] : data[i];
    } else {
      for (int64_t i = 0; i < n; ++i) data[i] += other[i];
    }
  }
}

// x: contiguous float32 or int32 of at most `capacity` elements, reduced over the ranks in place (sum, or
// max). Slots hold 4-byte elements of either type: every rank of one call passes the same dtype.
void all_reduce(torch::Tensor x, torch::Tensor region_tensor, int64_t rank, int64_t size, int64_t call,
                int64_t capacity, bool take_max, double timeout_s, int64_t parent_pid) {
  const bool is_int = x.scalar_type() == torch::kInt;
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == torch::kFloat || is_int) && x.is_contiguous(),
              "x: contiguous float32 or int32 CPU");
  TORCH_CHECK(x.numel() <= capacity, "x is larger than a slot");
  TORCH_CHECK(region_tensor.nbytes() >= static_cast<size_t>(kHeader + 2 * size * capacity * 4), "region too small");
  uint8_t* region = region_tensor.data_ptr<uint8_t>();
  const int64_t n = x.numel();
  uint8_t* slots = region + kHeader + (call % 2) * size * capacity * 4;
  void* data = x.data_ptr();
  pybind11::gil_scoped_release no_gil;  // other Python threads (the failure monitor) run while this waits
  std::memcpy(slots + rank * capacity * 4, data, n * 4);
  counter(region, rank)->store(static_cast<uint64_t>(call), std::memory_order_release);
  wait_for_all(region, size, static_cast<uint64_t>(call), timeout_s, parent_pid);
  if (is_int) {
    reduce_slots(static_cast<int32_t*>(data), reinterpret_cast<const int32_t*>(slots), n, size, capacity, take_max);
  } else {
    reduce_slots(static_cast<float*>(data), reinterpret_cast<const float*>(slots), n, size, capacity, take_max);
  }
}

// Rank `rank`'s x [N, widths[rank]] (contiguous float32, at most `capacity` elements) is published in its
// slot of the call's set; once every rank's is there, `out` [N, sum(widths)] (if given: rank 0's, or every
// rank's for an all-gather) receives the ranks' columns side by side, this rank's straight from x. Slots
// stay readable until this rank's next call but one: no rank writes this set before the next barrier.
void gather_columns(torch::Tensor x, c10::optional<torch::Tensor> out, torch::Tensor region_tensor, int64_t rank,
                    int64_t size, int64_t call, int64_t capacity, std::vector<int64_t> widths, double timeout_s,
                    int64_t parent_pid) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.dim() == 2,
              "x: contiguous [N, W] float32 CPU");
  TORCH_CHECK(static_cast<int64_t>(widths.size()) == size && x.size(1) == widths[rank], "x: [N, widths[rank]]");
  const int64_t rows = x.size(0);
  int64_t total = 0;
  for (int64_t w : widths) {
    TORCH_CHECK(rows * w <= capacity, "a part is larger than a slot");
    total += w;
  }
  float* op = nullptr;
  if (out.has_value() && out->defined()) {
    TORCH_CHECK(out->scalar_type() == torch::kFloat && out->is_contiguous() && out->dim() == 2 &&
                out->size(0) == rows && out->size(1) == total, "out: contiguous [N, sum(widths)] float32");
    op = out->data_ptr<float>();
  }
  TORCH_CHECK(region_tensor.nbytes() >= static_cast<size_t>(kHeader + 2 * size * capacity * 4), "region too small");
  uint8_t* region = region_tensor.data_ptr<uint8_t>();
  float* slots = reinterpret_cast<float*>(region + kHeader) + (call % 2) * size * capacity;
  const float* xp = x.data_ptr<float>();
  pybind11::gil_scoped_release no_gil;
  std::memcpy(slots + rank * capacity, xp, rows * widths[rank] * sizeof(float));
  counter(region, rank)->store(static_cast<uint64_t>(call), std::memory_order_release);
  wait_for_all(region, size, static_cast<uint64_t>(call), timeout_s, parent_pid);
  if (op == nullptr) return;
  int64_t offset = 0;
  for (int64_t r = 0; r < size; ++r) {
    const int64_t w = widths[r];
    const float* part = r == rank ? xp : slots + r * capacity;
    for (int64_t i = 0; i < rows; ++i) std::memcpy(op + i * total + offset, part + i * w, w * sizeof(float));
    offset += w;
  }
}

void set_abort(torch::Tensor region_tensor) {
  counter(region_tensor.data_ptr<uint8_t>(), kAbortSlot)->store(1, std::memory_order_release);
}
"""

_extension = LazyExtension("ladder_shared_memory_all_reduce", SOURCE, ["all_reduce", "gather_columns", "set_abort"],
                           "shared-memory all-reduce for CPU tensor parallelism")


def available() -> bool:
    return cpu_kernels_enabled() and _extension.load() is not None


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
        self.module = _extension.load()
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


if __name__ == "__main__":
    import sys

    sys.exit(_extension.build_and_report())
