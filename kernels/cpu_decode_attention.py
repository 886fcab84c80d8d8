"""Paged decode attention for the CPU: a small C++ kernel that reads each cached block in place.

The plain-torch path gathers every sequence's K and V blocks into a padded copy before attention;
on a CPU that copy is as expensive as the attention itself. This kernel walks the block table
instead, one (sequence, KV head) pair per task, with a float32 softmax over the whole context, so K
and V are read once and never copied. Grouped-query heads share each key they read.

It is compiled on first use with torch's C++ extension builder (a C++ compiler and ninja are needed;
the build is cached). If it cannot be built, `load()` returns None and the torch path is used.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import LazyExtension, cpu_kernels_enabled

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

// q [S, H, D] float32; kv_cache [2, num_blocks, block_size, KVH, D] float32; block_tables [S, max_blocks]
// int64; seq_lens [S] int64 (tokens in the cache, the query's own included). Query head j reads KV head
// j / (H / KVH). Returns [S, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale, int64_t sliding_window) {
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), BS = kv_cache.size(2), KVH = kv_cache.size(3);
  const int64_t G = H / KVH, max_blocks = block_tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = kv_cache.data_ptr<float>();
  const float* vp = kp + num_blocks * BS * KVH * D;
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, S * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / KVH, h = task % KVH, len = sl[s];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
      const int64_t n = len - first;
      scores.assign(G * n, 0.f);
      acc.assign(G * D, 0.f);
      const float* qs = qp + (s * H + h * G) * D;
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = first + t;
        const int64_t slot = bt[s * max_blocks + pos / BS] * BS + pos % BS;
        const float* k = kp + (slot * KVH + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qs + g * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
          scores[g * n + t] = dot * fscale;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* row = scores.data() + g * n;
        float top = -INFINITY;
        for (int64_t t = 0; t < n; ++t) top = std::max(top, row[t]);
        float total = 0.f;
        for (int64_t t = 0; t < n; ++t) { row[t] = std::exp(row[t] - top); total += row[t]; }
        const float inv = 1.f / total;
        for (int64_t t = 0; t < n; ++t) row[t] *= inv;
      }
      for (int64_t t = 0; t < n; ++t) {
        const int64_t pos = first + t;
        const int64_t slot = bt[s * max_blocks + pos / BS] * BS + pos % BS;
        const float* v = vp + (slot * KVH + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * n + t];
          float* a = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
        }
      }
      float* os = op + (s * H + h * G) * D;
      std::copy(acc.begin(), acc.end(), os);
    }
  });
  return out;
}
"""

_extension = LazyExtension("ladder_cpu_decode_attention", SOURCE, ["paged_decode_attention"],
                           "CPU decode attention kernel")


def load():
    """The compiled module, or None when it cannot be built here."""
    return _extension.load()


def is_enabled() -> bool:
    return cpu_kernels_enabled()


def paged_decode_attention(
    q: torch.Tensor,  # [S, H, D] float32, one query token per sequence
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D] float32
    block_tables: torch.Tensor,  # [S, max_blocks] int64
    seq_lens: torch.Tensor,  # [S] int64
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [S, H, D]
    module = load()
    if module is None:
        raise RuntimeError("the CPU decode attention kernel is not available")
    if q.dtype != torch.float32 or kv_cache.dtype != torch.float32:
        raise ValueError(f"float32 only, got q {q.dtype} and kv_cache {kv_cache.dtype}")
    if q.shape[1] % kv_cache.shape[3]:
        raise ValueError(f"{q.shape[1]} query heads do not group over {kv_cache.shape[3]} KV heads")
    return module.paged_decode_attention(q.contiguous(), kv_cache.contiguous(), block_tables.long().contiguous(),
                                         seq_lens.long().contiguous(), scale, sliding_window or 0)


if __name__ == "__main__":
    import sys

    sys.exit(_extension.build_and_report())
