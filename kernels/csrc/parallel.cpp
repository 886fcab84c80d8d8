// ladder::parallel_for's pool (parallel.h says why it is not OpenMP's).
//
// One job at a time. A job is published in `claim_`, one 64-bit word: the job's number in the high 32 bits,
// the next unclaimed piece in the low 32. A taker reads the word, then the job's fields, and claims piece
// i with a compare-and-swap of that same word to i + 1: the swap fails if a newer job was published in
// between, so fields read for an old job are never used. The caller waits until every claimed piece is
// done before it returns (and before it may publish the next job), so a taker's fields stay valid for as
// long as it runs the piece it claimed.
#include "parallel.h"

#include <ATen/Parallel.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ladder {
namespace {

inline void pause() {
#if defined(__x86_64__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

thread_local bool in_piece = false;  // this thread runs a piece: a loop inside it runs inline

using Clock = std::chrono::steady_clock;

class Pool {
 public:
  explicit Pool(int threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs the job to its end; false if the pool is busy with another caller's job (then run it inline).
  // `stalled` is set when the caller, done with its own pieces, waited on a worker's for longer than it
  // worked: that worker was not running.
  bool run(int64_t begin, int64_t end, int64_t piece, int64_t pieces,
           const std::function<void(int64_t, int64_t)>& f, bool& stalled) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    f_.store(&f, std::memory_order_relaxed);
    begin_.store(begin, std::memory_order_relaxed);
    end_.store(end, std::memory_order_relaxed);
    piece_.store(piece, std::memory_order_relaxed);
    pieces_.store(pieces, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint64_t job = (claim_.load(std::memory_order_relaxed) >> 32) + 1;
    claim_.store(job << 32, std::memory_order_release);
    if (sleepers_.load(std::memory_order_acquire) > 0) {
      std::lock_guard<std::mutex> lock(mutex_);  // a sleeper checks the job under this lock: no lost wake-up
      wake_.notify_all();
    }
    const auto start = Clock::now();
    while (take(job)) {
    }
    // Every piece is claimed now; wait for those a worker took. A worker that is slow to finish may be
    // waiting for this very core: after a short spin, give the core up between looks.
    const auto own = Clock::now();
    for (int spin = 0; done_.load(std::memory_order_acquire) < pieces; ++spin) {
      if (spin < kWaitSpins) {
        pause();
      } else {
        std::this_thread::yield();
      }
    }
    const auto waited = Clock::now() - own;
    stalled = waited > (own - start) + std::chrono::microseconds(20);
    return true;
  }

 private:
  // Claims one piece of job `job` and runs it; false when none is left (or the job is no longer current).
  bool take(uint64_t job) {
    uint64_t word = claim_.load(std::memory_order_acquire);
    for (;;) {
      if (word >> 32 != job) return false;
      const int64_t index = static_cast<int64_t>(word & 0xFFFFFFFFu);
      const auto* f = f_.load(std::memory_order_relaxed);
      const int64_t begin = begin_.load(std::memory_order_relaxed), end = end_.load(std::memory_order_relaxed);
      const int64_t piece = piece_.load(std::memory_order_relaxed), pieces = pieces_.load(std::memory_order_relaxed);
      if (index >= pieces) return false;
      if (claim_.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        const int64_t b = begin + index * piece;
        in_piece = true;
        (*f)(b, std::min(end, b + piece));
        in_piece = false;
        done_.fetch_add(1, std::memory_order_acq_rel);
        return true;
      }
    }
  }

  void work() {
    uint64_t seen = 0;
    for (;;) {
      // Spin a while for the next job (a step's loops come microseconds apart), then sleep.
      uint64_t job = claim_.load(std::memory_order_acquire) >> 32;
      for (int spin = 0; job == seen && spin < kSpins; ++spin) {
        pause();
        job = claim_.load(std::memory_order_acquire) >> 32;
      }
      if (job == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleepers_.fetch_add(1, std::memory_order_acq_rel);
        wake_.wait(lock, [&] { return stop_ || (claim_.load(std::memory_order_acquire) >> 32) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_acq_rel);
        if (stop_) return;
        job = claim_.load(std::memory_order_acquire) >> 32;
      }
      seen = job;
      while (take(job)) {
      }
    }
  }

  static constexpr int kSpins = 20000;  // about 0.1-0.5 ms of pause instructions
  static constexpr int kWaitSpins = 2000;

  std::vector<std::thread> workers_;
  std::mutex busy_;  // held by the caller of the current job
  std::atomic<uint64_t> claim_{0};
  std::atomic<const std::function<void(int64_t, int64_t)>*> f_{nullptr};
  std::atomic<int64_t> begin_{0}, end_{0}, piece_{1}, pieces_{0}, done_{0};
  std::atomic<int> sleepers_{0};
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
};

// Never destroyed: at exit its workers may be asleep in a wait, and a forked child has none to join.
std::mutex* pool_mutex = new std::mutex();
std::shared_ptr<Pool>* pool = new std::shared_ptr<Pool>();  // made again when torch's thread count changes

std::shared_ptr<Pool> current_pool(int threads) {
  std::lock_guard<std::mutex> lock(*pool_mutex);
  if (!*pool || (*pool)->threads() != threads) {
    pool->reset();  // its workers stop and are joined before new ones start
    *pool = std::make_shared<Pool>(threads);
  }
  return *pool;
}

// A forked child has this thread alone: forget the parent's pool without touching it (its threads are not
// the child's), and start with a fresh lock (another thread may have held it at the fork).
void forget_pool_in_child() {
  pool_mutex = new std::mutex();
  pool = new std::shared_ptr<Pool>();
}
const int fork_handler = pthread_atfork(nullptr, nullptr, forget_pool_in_child);

}  // namespace

// Sharing the cores: when the caller keeps waiting on workers that are not running (another process has
// their cores), loops run on the caller alone for a while, then try the pool again. kStallsToSolo stalls
// among the last kWindow pooled loops switch to kSoloLoops loops alone (about 20 decode steps of a small
// model), after which the pool is tried again.
constexpr int kWindow = 32, kStallsToSolo = 3, kSoloLoops = 4096;
std::atomic<int> solo_left{0};
std::atomic<uint32_t> recent_stalls{0};  // one bit per pooled loop, the newest lowest

// LADDER_CPU_POOL=0: OpenMP's at::parallel_for instead (benchmarks/shared_cores.py compares the two).
const bool use_pool = [] {
  const char* v = std::getenv("LADDER_CPU_POOL");
  return v == nullptr || std::string(v) != "0";
}();

void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f) {
  if (begin >= end) return;
  if (!use_pool) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  const int64_t range = end - begin;
  const int threads = at::get_num_threads();
  grain = std::max<int64_t>(grain, 1);
  // Two pieces a thread: a late worker can still take a share, and a busy core's share goes to the others.
  const int64_t pieces = std::min<int64_t>((range + grain - 1) / grain, 2 * static_cast<int64_t>(threads));
  if (pieces <= 1 || threads <= 1 || in_piece) {
    f(begin, end);
    return;
  }
  if (solo_left.load(std::memory_order_relaxed) > 0) {
    solo_left.fetch_sub(1, std::memory_order_relaxed);
    f(begin, end);
    return;
  }
  const int64_t piece = (range + pieces - 1) / pieces;
  const int64_t used = (range + piece - 1) / piece;
  auto p = current_pool(threads);
  bool stalled = false;
  if (!p->run(begin, end, piece, used, f, stalled)) {
    f(begin, end);
    return;
  }
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

}  // namespace ladder
