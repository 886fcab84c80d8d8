// The kernels' parallel loop: ladder::parallel_for(begin, end, grain, f), at::parallel_for (OpenMP) with a
// guard for cores that another process shares.
//
// OpenMP gives each thread a fixed share of a loop and ends it at a barrier, so the calling thread waits
// for every thread to be scheduled and to finish its share. Beside another busy process on a 2-core
// machine, each of a decode step's ~100 loops waited for a descheduled thread's next time slice: Gemma 3
// 270M's layers took 400 ms a step instead of 2.7 ms. The guard times each loop: when the calling thread,
// done with its own share, keeps waiting longer than it worked and 2 ms more (kStallsToSolo such loops
// among the last kWindow), the next kSoloLoops loops (tens of decode steps) run on the calling thread
// alone, and then OpenMP is tried again. Only short loops (up to 16 grains: a decode step's at small
// batches) are guarded: a long loop's split is worth an occasional wait, as when a busy server's own
// threads (HTTP, detokenizing) take a core now and then at a large batch. A thread alone there gets its core's share of the machine instead of waiting
// on two.
//
// The results never depend on the split: every kernel computes each output on its own, in a fixed order.
// LADDER_CPU_STALL_GUARD=0, read once, turns the guard off (benchmarks/shared_cores.py compares the two).
#pragma once

#include <cstdint>
#include <functional>

namespace ladder {

void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f);

}  // namespace ladder
