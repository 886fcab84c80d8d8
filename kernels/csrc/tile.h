// What the blocked linear kernels share: the packed layout's block width, the table of tiles (MR rows by
// NB blocks of 16 output channels, each size its own template instance), the parallel loop over blocks
// and rows, and the argument checks.
//
// A kernel describes its tiles as a struct K with
//   using Fn = ...;                                 the tile's function pointer type
//   static constexpr int kMaxMr;                    the most rows one tile holds
//   static constexpr int kMaxNb[kMaxMr + 1];        per row count, the widest group of blocks whose
//                                                   accumulators fit the vector registers (32 with
//                                                   AVX-512, 16 with AVX2)
//   template <int MR, int NB> static void tile(...);
// Only the tiles the table allows are instantiated.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "parallel.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// The int8 kernels' dot products: vpdpbusd (AVX512-VNNI) with AVX512BW's byte arithmetic; else, on AVX2,
// vpmaddubsw (byte pairs into int16) and vpmaddwd (int16 pairs into int32), kept below int16's range so
// that the sums stay exact (each kernel says why its operands cannot saturate).
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define LADDER_VNNI 1
#elif defined(__AVX2__)
#define LADDER_AVX2_INT8 1
#endif

namespace ladder {

constexpr int BN = 16;  // output channels per packed block

template <class K, int MR, int NB = 1>
typename K::Fn pick_nb(int nb) {
  if constexpr (NB > K::kMaxNb[MR]) {
    TORCH_CHECK(false, "no ", MR, "x", nb, " tile");
    return nullptr;
  } else {
    return nb == NB ? &K::template tile<MR, NB> : pick_nb<K, MR, NB + 1>(nb);
  }
}

// The tile of mr rows by nb blocks.
template <class K, int MR = 1>
typename K::Fn pick(int mr, int nb) {
  if constexpr (MR > K::kMaxMr) {
    TORCH_CHECK(false, "no ", mr, "-row tile");
    return nullptr;
  } else {
    return mr == MR ? pick_nb<K, MR>(nb) : pick<K, MR + 1>(mr, nb);
  }
}

// Threads split the NBLK blocks of output channels, each thread at least `min_work` multiply-adds
// (`work_per_block` each) so that tiny problems stay on one thread. A thread walks its blocks a group at
// a time, the widest group a tile of min(M, kMaxMr) rows holds, and the rows kMaxMr at a time:
// call(tile, m, b) computes rows m .. m + mr of blocks b .. b + nb. kMaxNb never grows with the row
// count, so the tile of the last, shorter row group covers the whole group of blocks too.
template <class K, class Call>
void for_each_tile(int64_t M, int64_t NBLK, int64_t work_per_block, int64_t min_work, const Call& call) {
  const int group = K::kMaxNb[std::min<int64_t>(M, K::kMaxMr)];
  const int64_t work = std::max<int64_t>(1, work_per_block);
  const int64_t grain = std::max<int64_t>(1, (min_work + work - 1) / work);
  parallel_for(0, NBLK, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b += group) {
      const int nb = static_cast<int>(std::min<int64_t>(group, b1 - b));
      for (int64_t m = 0; m < M; m += K::kMaxMr) {
        const int mr = static_cast<int>(std::min<int64_t>(K::kMaxMr, M - m));
        call(pick<K>(mr, nb), m, b);
      }
    }
  });
}

#ifdef __AVX512F__
// The lanes of a block of 16 output channels that exist: all 16 but in the last block.
inline __mmask16 tail_mask(int64_t left) {
  return left >= BN ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}
#endif

#ifdef LADDER_AVX2_INT8
// max |x[k]| over x [n], as the portable loops take it: the order of a maximum does not matter, and
// _mm256_max_ps returns its second operand where one is NaN, so a NaN x is skipped as std::max(amax, NaN)
// skips it.
inline float max_abs(const float* x, int64_t n) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + k), magnitude), m);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  for (; k < n; ++k) amax = std::max(amax, std::fabs(x[k]));
  return amax;
}

// The lanes of 8 output channels that exist (all 8 but at the end of the last block), for
// _mm256_maskload_ps / _mm256_maskstore_ps.
inline __m256i tail_mask8(int64_t left) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(std::min<int64_t>(left, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// The 8 int32 lanes of v, each known to lie in 0..255, as 8 bytes in lane order.
inline __m128i bytes8(__m256i v) {
  const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  return _mm_packus_epi16(words, words);
}
#endif

// x [M, K] float32, contiguous, on the CPU.
inline void check_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x: [M, K] float32 contiguous CPU");
}

// A packed weight of NBLK blocks of 16 output channels holds N of them.
inline void check_blocks(int64_t N, int64_t NBLK) {
  TORCH_CHECK(N > (NBLK - 1) * BN && N <= NBLK * BN, "n ", N, " does not match ", NBLK, " packed blocks");
}

// The data of a float32 [n] vector (a scale, a bias).
inline const float* vector_data(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n,
              name, ": [", n, "] float32 contiguous CPU");
  return t.data_ptr<float>();
}

// The same for an optional one: nullptr when absent.
inline const float* optional_vector_data(const std::optional<at::Tensor>& t, int64_t n, const char* name) {
  return t.has_value() && t->defined() ? vector_data(*t, n, name) : nullptr;
}

// What an op takes, as the kernels take it: x [..., K] of any float dtype -> [M, K] float32 contiguous.
inline at::Tensor float_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1, "x must have a last dimension");
  return x.reshape({-1, x.size(-1)}).to(at::kFloat).contiguous();
}

inline std::optional<at::Tensor> float_vector(const std::optional<at::Tensor>& t) {
  if (!t.has_value() || !t->defined()) return std::nullopt;
  return t->to(at::kFloat).contiguous();
}

// x's shape with the last dimension n.
inline std::vector<int64_t> sizes_with_last(const at::Tensor& x, int64_t n) {
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  return sizes;
}

}  // namespace ladder
