// All-reduce and column gather through one shared mapped region, for the ranks of one host's CPU
// tensor-parallel group. The region: a header of per-rank arrival counters (one cache line each) and an
// abort flag, then two sets of `size` slots of `capacity` 4-byte elements. Call g publishes the rank's
// slot in set g % 2, waits for every rank's g, then reads the slots in rank order, so every rank holds
// bit-identical results; two sets make one barrier per call enough. They are ops of the ladder_cpu
// namespace, called from Python through torch.ops, which releases the GIL around the call: other Python
// threads (the failure monitor) run while a rank waits.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ladder {

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

}  // namespace

// x: contiguous float32 or int32 of at most `capacity` elements, reduced over the ranks in place (sum, or
// max). Slots hold 4-byte elements of either type: every rank of one call passes the same dtype.
void all_reduce(at::Tensor x, at::Tensor region_tensor, int64_t rank, int64_t size, int64_t call,
                int64_t capacity, bool take_max, double timeout_s, int64_t parent_pid) {
  const bool is_int = x.scalar_type() == at::kInt;
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || is_int) && x.is_contiguous(),
              "x: contiguous float32 or int32 CPU");
  TORCH_CHECK(x.numel() <= capacity, "x is larger than a slot");
  TORCH_CHECK(region_tensor.nbytes() >= static_cast<size_t>(kHeader + 2 * size * capacity * 4), "region too small");
  uint8_t* region = region_tensor.data_ptr<uint8_t>();
  const int64_t n = x.numel();
  uint8_t* slots = region + kHeader + (call % 2) * size * capacity * 4;
  void* data = x.data_ptr();
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
void gather_columns(at::Tensor x, std::optional<at::Tensor> out, at::Tensor region_tensor, int64_t rank,
                    int64_t size, int64_t call, int64_t capacity, at::IntArrayRef widths, double timeout_s,
                    int64_t parent_pid) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2,
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
    TORCH_CHECK(out->scalar_type() == at::kFloat && out->is_contiguous() && out->dim() == 2 &&
                out->size(0) == rows && out->size(1) == total, "out: contiguous [N, sum(widths)] float32");
    op = out->data_ptr<float>();
  }
  TORCH_CHECK(region_tensor.nbytes() >= static_cast<size_t>(kHeader + 2 * size * capacity * 4), "region too small");
  uint8_t* region = region_tensor.data_ptr<uint8_t>();
  float* slots = reinterpret_cast<float*>(region + kHeader) + (call % 2) * size * capacity;
  const float* xp = x.data_ptr<float>();
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

void set_abort(at::Tensor region_tensor) {
  counter(region_tensor.data_ptr<uint8_t>(), kAbortSlot)->store(1, std::memory_order_release);
}

}  // namespace ladder

TORCH_LIBRARY_FRAGMENT(ladder_cpu, m) {
  m.def("all_reduce(Tensor(a!) x, Tensor(b!) region, int rank, int size, int call, int capacity, bool take_max, "
        "float timeout_s, int parent_pid) -> ()", &ladder::all_reduce);
  m.def("gather_columns(Tensor x, Tensor(a!)? out, Tensor(b!) region, int rank, int size, int call, int capacity, "
        "int[] widths, float timeout_s, int parent_pid) -> ()", &ladder::gather_columns);
  m.def("set_abort(Tensor(a!) region) -> ()", &ladder::set_abort);
}
