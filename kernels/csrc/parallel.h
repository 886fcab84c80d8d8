// The kernels' parallel loop: ladder::parallel_for(begin, end, grain, f) calls f(b, e) on pieces of
// [begin, end), each at least `grain` long, on this thread and the pool's workers (at::get_num_threads()
// threads in all).
//
// Why not at::parallel_for (OpenMP): it hands each thread a fixed share and ends at a barrier, so the
// caller waits for every thread to be scheduled and to finish its share. On a machine whose cores another
// process shares, a decode step's ~100 loops each waited for a descheduled thread's next time slice: a
// 5 ms step of Gemma 3 270M took 400 ms beside a busy server. Here the pieces are claimed one at a time,
// the caller claims too, and it waits only for pieces a worker has actually taken: a worker that is not
// running takes none, and the caller does its share. Workers spin briefly between loops (the loops of a
// step follow each other within microseconds), then sleep.
//
// The results never depend on who computes a piece: every kernel computes each output on its own, in a
// fixed order, whatever the split. A loop inside a piece (nested) runs inline, and so does a loop started
// while another thread's loop holds the pool. LADDER_CPU_POOL=0, read once, runs OpenMP's loop instead.
#pragma once

#include <cstdint>
#include <functional>

namespace ladder {

void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& f);

}  // namespace ladder
