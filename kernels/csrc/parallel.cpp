// ladder::parallel_for: at::parallel_for with the stall guard parallel.h describes.
#include "parallel.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <string>

namespace ladder {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kWindow = 32, kStallsToSolo = 3, kSoloLoops = 4096, kShortGrains = 16;
// Waits shorter than this are not stalls: a thread waking (hundreds of microseconds where a virtual CPU
// has to be woken) is not a core lost to another process, which costs a time slice.
const auto kSlack = std::chrono::milliseconds(2);

const bool guard_on = [] {
  const char* v = std::getenv("LADDER_CPU_STALL_GUARD");
  return v == nullptr || std::string(v) != "0";
}();

std::atomic<int> solo_left{0};
std::atomic<uint32_t> recent_stalls{0};  // one bit per guarded loop, the newest lowest

// Shifts a loop's outcome into the window; enough stalls there switch to running alone for a while.
void record(bool stalled) {
  const uint32_t window = static_cast<uint32_t>(
      (static_cast<uint64_t>(recent_stalls.load(std::memory_order_relaxed)) << 1 | (stalled ? 1u : 0u)) &
      ((uint64_t{1} << kWindow) - 1u));
  if (__builtin_popcount(window) >= kStallsToSolo) {
    solo_left.store(kSoloLoops, std::memory_order_relaxed);
    recent_stalls.store(0, std::memory_order_relaxed);
  } else {
    recent_stalls.store(window, std::memory_order_relaxed);
  }
}

}  // namespace

void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f) {
  if (begin >= end) return;
  const bool split = end - begin > std::max<int64_t>(grain, 1) && at::get_num_threads() > 1 && !at::in_parallel_region();
  if (!split || !guard_on) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  // Only short loops (a few grains: a decode step's at small batches) run alone; a long loop's split is
  // worth an occasional wait (a large batch's, beside a busy server's own threads).
  const bool short_loop = (end - begin) <= kShortGrains * std::max<int64_t>(grain, 1);
  if (!short_loop) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  if (solo_left.load(std::memory_order_relaxed) > 0) {
    solo_left.fetch_sub(1, std::memory_order_relaxed);
    f(begin, end);
    return;
  }
  const auto start = Clock::now();
  std::atomic<int64_t> own_end{0};  // when the calling thread (OpenMP's thread 0) finished its share
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
    f(b, e);
    if (at::get_thread_num() == 0) own_end.store((Clock::now() - start).count(), std::memory_order_relaxed);
  });
  const auto total = Clock::now() - start;
  const Clock::duration own(own_end.load(std::memory_order_relaxed));
  record(own.count() > 0 && total - own > own + kSlack);
}

}  // namespace ladder
