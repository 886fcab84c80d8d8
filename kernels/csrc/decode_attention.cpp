// Paged decode attention: one query token per sequence against its cached blocks, read in place through the
// block table. One task per (sequence, KV head); a float32 softmax over the whole context. The cache holds
// float32, bfloat16 or float16; q and the output have the cache's dtype, or float32 over a 16-bit cache (a
// float32 model with a 16-bit KV cache, `--kv-cache-dtype`). 16-bit elements are widened as loaded.
// The common shapes (head size 64, 128 or 256, blocks of 16 tokens, up to 8 query heads per KV head) run a
// specialised vector task, on AVX-512 or AVX2 (an AMD Zen 3 host's case; float16 there needs F16C); other
// shapes run the portable loop.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_kernels.h"
#include "parallel.h"
#include "vec_exp.h"

#include <algorithm>
#include <optional>
#include <cmath>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define LADDER_ATTENTION_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define LADDER_ATTENTION_AVX2 1
#endif

namespace ladder {
namespace {

// q [S, H, D] Q; kv_cache [2, num_blocks, block_size, KVH, D] T; block_tables [S, max_blocks] int64;
// seq_lens [S] int64 (tokens in the cache, the query's own included); out [S, H, D] Q. T is float,
// c10::BFloat16 or c10::Half, Q is T or float; arithmetic is float32 throughout. Query head j reads KV
// head j / (H / KVH).
// Tokens [first, len) are attended (first > 0 only with a sliding window).
// Query row s starts at q + s * q_stride and output row s at out + s * out_stride (H * D when contiguous).
// `sinks` [H] (null: none): each query head's sink logit (GPT-OSS), one more term exp(sink - max) in the
// softmax's denominator with no value: out = sum_t exp(s_t - M) v_t / (sum_t exp(s_t - M) + exp(sink - M)).
template <typename Q, typename T>
struct Problem {
  const Q* q; const T* k; const T* v; const int64_t* tables; Q* out;
  int64_t H, D, KVH, G, BS, max_blocks;
  float scale;
  int64_t q_stride, out_stride;
  const float* sinks;
};

// The sink logit of query head j (-inf without sinks).
template <typename Q, typename T>
inline float sink_of(const Problem<Q, T>& p, int64_t j) {
  return p.sinks ? p.sinks[j] : -INFINITY;
}

// Portable version: any G and D, vectorised by the compiler where it can. `query` holds the G query rows
// widened to float32 (a scratch buffer per thread).
template <typename Q, typename T>
void task_generic(const Problem<Q, T>& p, int64_t s, int64_t h, int64_t first, int64_t len,
                         std::vector<float>& scores, std::vector<float>& acc, std::vector<float>& query) {
  const int64_t G = p.G, D = p.D, n = len - first;
  scores.assign(G * n, 0.f);
  acc.assign(G * D, 0.f);
  query.resize(G * D);
  const Q* qs = p.q + s * p.q_stride + h * G * D;
  for (int64_t i = 0; i < G * D; ++i) query[i] = static_cast<float>(qs[i]);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t pos = first + t;
    const int64_t slot = p.tables[s * p.max_blocks + pos / p.BS] * p.BS + pos % p.BS;
    const T* k = p.k + (slot * p.KVH + h) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = query.data() + g * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * static_cast<float>(k[d]);
      scores[g * n + t] = dot * p.scale;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* row = scores.data() + g * n;
    const float sink = sink_of(p, h * G + g);
    float top = sink;
    for (int64_t t = 0; t < n; ++t) top = std::max(top, row[t]);
    float total = p.sinks ? std::exp(sink - top) : 0.f;
    for (int64_t t = 0; t < n; ++t) { row[t] = std::exp(row[t] - top); total += row[t]; }
    const float inv = 1.f / total;
    for (int64_t t = 0; t < n; ++t) row[t] *= inv;
  }
  for (int64_t t = 0; t < n; ++t) {
    const int64_t pos = first + t;
    const int64_t slot = p.tables[s * p.max_blocks + pos / p.BS] * p.BS + pos % p.BS;
    const T* v = p.v + (slot * p.KVH + h) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float w = scores[g * n + t];
      float* a = acc.data() + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += w * static_cast<float>(v[d]);
    }
  }
  Q* os = p.out + s * p.out_stride + h * G * D;
  for (int64_t i = 0; i < G * D; ++i) os[i] = static_cast<Q>(acc[i]);  // round to nearest even
}

#if defined(__AVX512F__)
// 16 elements widened to float32. bfloat16 is the top half of a float32: widen and shift. float16 by
// the F16C conversion every AVX-512 CPU has.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 float32 results rounded to nearest even, as torch's conversions round (c10's for bfloat16: a
// NaN becomes the quiet 0x7FC0).
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i top = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  top = _mm512_mask_mov_epi32(top, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(top));
}
inline void store16(c10::Half* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// v[i] holds 16 partial sums of dot product i; returns the 16 dot products, lane i = sum of v[i]'s lanes.
// A transposing tree of 15 adds instead of 16 separate horizontal reductions.
inline __m512 sum_lanes16(const __m512* v) {
  __m512 pair[8], quad[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3
    pair[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane j: the lane-j sums of four vectors
    quad[i] = _mm512_add_ps(_mm512_shuffle_ps(pair[2 * i], pair[2 * i + 1], 0x44),
                            _mm512_shuffle_ps(pair[2 * i], pair[2 * i + 1], 0xEE));
  const __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(quad[0], quad[1], 0x88), _mm512_shuffle_f32x4(quad[0], quad[1], 0xDD));
  const __m512 hi = _mm512_add_ps(_mm512_shuffle_f32x4(quad[2], quad[3], 0x88), _mm512_shuffle_f32x4(quad[2], quad[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, 0x88), _mm512_shuffle_f32x4(lo, hi, 0xDD));
}

#endif

#if defined(__AVX512F__)
// The vector operations the task below is written in, on AVX-512's 16 float32 lanes (every cache dtype).
struct Vec16 {
  using R = __m512;
  static constexpr int W = 16;
  template <typename T>
  static R load(const T* p) { return load16(p); }
  template <typename T>
  static void store(T* p, R x) { store16(p, x); }
  static R loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void storeu(float* p, R x) { _mm512_storeu_ps(p, x); }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static R max(R a, R b) { return _mm512_max_ps(a, b); }
  static R fmadd(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static float reduce_max(R x) { return _mm512_reduce_max_ps(x); }
  static float reduce_add(R x) { return _mm512_reduce_add_ps(x); }
  static R sum_lanes(const R* v) { return sum_lanes16(v); }
  static R exp(R x) { return exp16(x); }  // of scores minus their maximum (x <= 0)
  // Lane i keeps x where bit i of `valid` is set, else -inf.
  static R or_minus_inf(unsigned valid, R x) {
    return _mm512_mask_blend_ps(static_cast<__mmask16>(valid), _mm512_set1_ps(-INFINITY), x);
  }
};
#endif

#if defined(LADDER_ATTENTION_AVX2)
// v[i] holds 8 partial sums of dot product i; returns the 8 dot products, lane i = sum of v[i]'s lanes.
inline __m256 sum_lanes8(const __m256* v) {
  __m256 pair[4], quad[2];
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3
    pair[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i)  // per 128-bit lane j: the lane-j sums of four vectors
    quad[i] = _mm256_add_ps(_mm256_shuffle_ps(pair[2 * i], pair[2 * i + 1], 0x44),
                            _mm256_shuffle_ps(pair[2 * i], pair[2 * i + 1], 0xEE));
  return _mm256_add_ps(_mm256_permute2f128_ps(quad[0], quad[1], 0x20), _mm256_permute2f128_ps(quad[0], quad[1], 0x31));
}

// The same operations on AVX2's 8 lanes; 16-bit elements widened and rounded as in load16 / store16
// (float16 by F16C, which every AVX2 CPU seen so far has; without it float16 takes the portable loop).
struct Vec8 {
  using R = __m256;
  static constexpr int W = 8;
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, R x) { _mm256_storeu_ps(p, x); }
  static R load(const c10::BFloat16* p) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
  }
  static void store(c10::BFloat16* p, R x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    top = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(top), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)), nan));
    // Within each 128-bit half: the four 16-bit values, twice; then the halves' first quads side by side.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(top, top), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
#if defined(__F16C__)
  static R load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store(c10::Half* p, R x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#endif
  static R loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void storeu(float* p, R x) { _mm256_storeu_ps(p, x); }
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R max(R a, R b) { return _mm256_max_ps(a, b); }
  static R fmadd(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static float reduce_max(R x) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  }
  static float reduce_add(R x) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
  }
  static R sum_lanes(const R* v) { return sum_lanes8(v); }
  static R exp(R x) { return exp8(x); }  // of scores minus their maximum (x <= 0)
  static R or_minus_inf(unsigned valid, R x) {
    const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(valid)), bits), bits);
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), x, _mm256_castsi256_ps(on));
  }
};
#endif

#if defined(LADDER_ATTENTION_AVX512) || defined(LADDER_ATTENTION_AVX2)
// Into L2 (T1) rather than L1 (T0): the L1's few miss buffers limit how many lines can be in flight.
// stride: elements between rows; lines: 64-byte lines per row.
template <typename T>
inline void prefetch_rows(const T* base, int64_t stride, int64_t rows, int64_t lines) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t l = 0; l < lines; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(base + r * stride) + l * 64, _MM_HINT_T1);
}

// G query heads sharing one KV head, head size V::W * DV; cache blocks of 16 tokens. Two passes over the
// tokens [first, len): scores (block by block, 16 tokens at a time), softmax, then the weighted sum of V;
// the next block's rows are prefetched while one block is computed, since blocks lie anywhere in the
// cache. `partial` null: the output rows. Else a chunk of a longer context: per query head its maximum
// score, its sum of weights exp(score - maximum) and the unnormalized weighted sum of V [D], at
// partial + g * (D + 2), for `combine_chunks`.
template <typename Q, typename T, int G, int DV, class V>
void task_vector(const Problem<Q, T>& p, int64_t s, int64_t h, int64_t first, int64_t len, float* scores,
                 float* partial) {
  using R = typename V::R;
  constexpr int64_t BS = 16, D = V::W * DV;
  constexpr int64_t LINES = D * static_cast<int64_t>(sizeof(T)) / 64;  // cache lines per token row
  const int64_t row_stride = p.KVH * D;  // elements between consecutive tokens of a block
  const int64_t first_block = first / BS, last_block = (len - 1) / BS;
  const int64_t n = (last_block - first_block + 1) * BS;  // scores cover whole blocks; masked outside
  const int64_t* table = p.tables + s * p.max_blocks;
  auto block_rows = [&](const T* base, int64_t b) { return base + (table[b] * BS * p.KVH + h) * D; };
  // The attended tokens [lo, hi) of block b: all 16 but for a window's start or the context's end.
  auto attended = [&](int64_t b) {
    return std::make_pair(std::max<int64_t>(first - b * BS, 0), std::min<int64_t>(len - b * BS, BS));
  };
  const Q* qs = p.q + s * p.q_stride + h * G * D;
  R qv[G][DV];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < DV; ++d) qv[g][d] = V::mul(V::load(qs + g * D + V::W * d), V::set1(p.scale));
  R top[G];
  for (int g = 0; g < G; ++g) top[g] = V::set1(-INFINITY);
  prefetch_rows(block_rows(p.k, first_block), row_stride, BS, LINES);
  for (int64_t b = first_block; b <= last_block; ++b) {
    const T* rows = block_rows(p.k, b);
    if (b < last_block) prefetch_rows(block_rows(p.k, b + 1), row_stride, BS, LINES);
    else prefetch_rows(block_rows(p.v, first_block), row_stride, BS, LINES);
    R partial[G][BS];
    for (int64_t t = 0; t < BS; ++t) {
      R kv[DV];
      for (int d = 0; d < DV; ++d) kv[d] = V::load(rows + t * row_stride + V::W * d);
      for (int g = 0; g < G; ++g) {
        R a = V::mul(qv[g][0], kv[0]);
        for (int d = 1; d < DV; ++d) a = V::fmadd(qv[g][d], kv[d], a);
        partial[g][t] = a;
      }
    }
    // Tokens outside [first, len) (a block's unused tail, or before a sliding window) get -inf.
    const auto [lo, hi] = attended(b);
    const unsigned valid = ((1u << hi) - 1) & ~((1u << lo) - 1);
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < BS / V::W; ++c) {  // V::W tokens at a time
        const R dots = V::or_minus_inf(valid >> (c * V::W), V::sum_lanes(partial[g] + c * V::W));
        V::storeu(scores + g * n + (b - first_block) * BS + c * V::W, dots);
        top[g] = V::max(top[g], dots);
      }
    }
  }
  float inv_total[G], maximum[G], total_of[G];
  for (int g = 0; g < G; ++g) {
    maximum[g] = V::reduce_max(top[g]);
    const R m = V::set1(maximum[g]);
    R total = V::set1(0.f);
    for (int64_t t = 0; t < n; t += V::W) {
      const R e = V::exp(V::sub(V::loadu(scores + g * n + t), m));
      V::storeu(scores + g * n + t, e);
      total = V::add(total, e);
    }
    total_of[g] = V::reduce_add(total);
    inv_total[g] = 1.f / total_of[g];
  }
  R acc[G][DV];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < DV; ++d) acc[g][d] = V::set1(0.f);
  for (int64_t b = first_block; b <= last_block; ++b) {
    const T* rows = block_rows(p.v, b);
    if (b < last_block) prefetch_rows(block_rows(p.v, b + 1), row_stride, BS, LINES);
    const float* w = scores + (b - first_block) * BS;
    // Only attended tokens: a block's unused tail may hold anything, and 0 * NaN is not 0.
    const auto [lo, hi] = attended(b);
    for (int64_t t = lo; t < hi; ++t) {
      R vv[DV];
      for (int d = 0; d < DV; ++d) vv[d] = V::load(rows + t * row_stride + V::W * d);
      for (int g = 0; g < G; ++g) {
        const R weight = V::set1(w[g * n + t]);
        for (int d = 0; d < DV; ++d) acc[g][d] = V::fmadd(weight, vv[d], acc[g][d]);
      }
    }
  }
  if (partial) {
    for (int g = 0; g < G; ++g) {
      float* pg = partial + g * (D + 2);
      pg[0] = maximum[g];
      pg[1] = total_of[g];
      for (int d = 0; d < DV; ++d) V::storeu(pg + 2 + V::W * d, acc[g][d]);
    }
    return;
  }
  if (p.sinks) {  // the sink's term joins the denominator: sums rescaled to the larger of the two maxima
    for (int g = 0; g < G; ++g) {
      const float sink = p.sinks[h * G + g], top = std::max(maximum[g], sink), f = std::exp(maximum[g] - top);
      inv_total[g] = f / (total_of[g] * f + std::exp(sink - top));
    }
  }
  Q* os = p.out + s * p.out_stride + h * G * D;
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < DV; ++d) V::store(os + g * D + V::W * d, V::mul(acc[g][d], V::set1(inv_total[g])));
}

template <typename Q, typename T>
using VectorTask = void (*)(const Problem<Q, T>&, int64_t, int64_t, int64_t, int64_t, float*, float*);

template <typename Q, typename T, int DV, class V>
VectorTask<Q, T> pick_group(int64_t G) {
  switch (G) {
    case 1: return task_vector<Q, T, 1, DV, V>;
    case 2: return task_vector<Q, T, 2, DV, V>;
    case 3: return task_vector<Q, T, 3, DV, V>;
    case 4: return task_vector<Q, T, 4, DV, V>;
    case 5: return task_vector<Q, T, 5, DV, V>;
    case 6: return task_vector<Q, T, 6, DV, V>;
    case 7: return task_vector<Q, T, 7, DV, V>;
    case 8: return task_vector<Q, T, 8, DV, V>;
    default: return nullptr;
  }
}

// The specialised task for this shape, or nullptr (then the portable one runs).
template <typename Q, typename T>
VectorTask<Q, T> pick_vector(int64_t G, int64_t D, int64_t BS) {
#if defined(LADDER_ATTENTION_AVX512)
  using V = Vec16;
#else
  using V = Vec8;
#if !defined(__F16C__)
  if constexpr (std::is_same_v<T, c10::Half> || std::is_same_v<Q, c10::Half>) return nullptr;  // no F16C
  else
#endif
#endif
  {
    if (BS != 16) return nullptr;
    if (D == 64) return pick_group<Q, T, 64 / V::W, V>(G);
    if (D == 128) return pick_group<Q, T, 128 / V::W, V>(G);
    if (D == 256) return pick_group<Q, T, 256 / V::W, V>(G);  // Gemma 3
    return nullptr;
  }
}
#endif

// The portable loop: one task per (sequence, KV head).
template <typename Q, typename T>
void run_generic(const Problem<Q, T>& p, int64_t S, const int64_t* sl, int64_t sliding_window) {
  parallel_for(0, S * p.KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc, query;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / p.KVH, h = task % p.KVH, len = sl[s];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
      task_generic(p, s, h, first, len, scores, acc, query);
    }
  });
}

#if defined(LADDER_ATTENTION_AVX512) || defined(LADDER_ATTENTION_AVX2)
// The vector task cuts a context longer than kChunk tokens at multiples of kChunk: every chunk is a task
// of its own, and the chunks' partial softmaxes are combined in order afterwards. The cuts depend on the
// positions alone, so a sequence's output is the same in any batch; at batch 1 a long context then keeps
// every thread busy, not one per KV head (Gemma 3 270M has a single KV head).
constexpr int64_t kChunk = 128;  // tokens: 8 of the vector task's 16-token blocks

// One task: sequence s, KV head h, its tokens [lo, hi), and where its partial result goes (-1: the
// sequence has one chunk, the task writes the output rows).
struct ChunkTask {
  int64_t s, h, lo, hi, partial;
};

// out rows of (s, h) from its chunks' partials, in chunk order: with M the largest chunk maximum, each
// chunk's sums scaled by exp(m_c - M), the weighted sums added and divided by the weights' total.
template <typename Q, typename T>
void combine_chunks(const Problem<Q, T>& p, int64_t s, int64_t h, const float* partials, int64_t chunks) {
  const int64_t G = p.G, D = p.D, width = G * (D + 2);
  Q* os = p.out + s * p.out_stride + h * G * D;
  std::vector<float> acc(D);
  for (int64_t g = 0; g < G; ++g) {
    const float sink = sink_of(p, h * G + g);
    float top = sink;
    for (int64_t c = 0; c < chunks; ++c) top = std::max(top, partials[c * width + g * (D + 2)]);
    float total = p.sinks ? std::exp(sink - top) : 0.f;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t c = 0; c < chunks; ++c) {
      const float* pc = partials + c * width + g * (D + 2);
      const float f = std::exp(pc[0] - top);
      total += pc[1] * f;
      for (int64_t d = 0; d < D; ++d) acc[d] += pc[2 + d] * f;
    }
    const float inv = 1.f / total;
    for (int64_t d = 0; d < D; ++d) os[g * D + d] = static_cast<Q>(acc[d] * inv);
  }
}

template <typename Q, typename T>
void run_vector(const Problem<Q, T>& p, VectorTask<Q, T> fast, int64_t S, const int64_t* sl, int64_t sliding_window) {
  const int64_t KVH = p.KVH, BS = p.BS, width = p.G * (p.D + 2);
  std::vector<ChunkTask> tasks;
  std::vector<std::pair<int64_t, int64_t>> combined;  // (first task, chunks) of each split (s, h)
  int64_t partial_floats = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t len = sl[s];
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
    const int64_t c0 = first / kChunk, c1 = (len - 1) / kChunk + 1;  // chunks that hold attended tokens
    for (int64_t h = 0; h < KVH; ++h) {
      if (c1 - c0 == 1) {
        tasks.push_back({s, h, first, len, -1});
        continue;
      }
      combined.emplace_back(static_cast<int64_t>(tasks.size()), c1 - c0);
      for (int64_t c = c0; c < c1; ++c) {
        tasks.push_back({s, h, std::max(first, c * kChunk), std::min(len, (c + 1) * kChunk), partial_floats});
        partial_floats += width;
      }
    }
  }
  std::vector<float> partials(partial_floats);
  parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const ChunkTask& t = tasks[i];
      scores.resize(p.G * ((t.hi - 1) / BS - t.lo / BS + 1) * BS);
      fast(p, t.s, t.h, t.lo, t.hi, scores.data(), t.partial < 0 ? nullptr : partials.data() + t.partial);
    }
  });
  parallel_for(0, static_cast<int64_t>(combined.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const ChunkTask& t = tasks[combined[i].first];
      combine_chunks(p, t.s, t.h, partials.data() + t.partial, combined[i].second);
    }
  });
}
#endif

template <typename Q, typename T>
void run(const Problem<Q, T>& p, int64_t S, const int64_t* sl, int64_t sliding_window, bool portable) {
#if defined(LADDER_ATTENTION_AVX512) || defined(LADDER_ATTENTION_AVX2)
  if (const VectorTask<Q, T> fast = portable ? nullptr : pick_vector<Q, T>(p.G, p.D, p.BS)) {
    run_vector(p, fast, S, sl, sliding_window);
    return;
  }
#endif
  run_generic(p, S, sl, sliding_window);
}

template <typename Q, typename T>
void run_typed(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
               const at::Tensor& seq_lens, at::Tensor& out, double scale, int64_t sliding_window, bool portable,
               const float* sinks) {
  const int64_t H = q.size(1), D = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), BS = kv_cache.size(2), KVH = kv_cache.size(3);
  const T* kp = kv_cache.data_ptr<T>();
  const Problem<Q, T> p{q.data_ptr<Q>(), kp, kp + num_blocks * BS * KVH * D, block_tables.data_ptr<int64_t>(),
                        out.data_ptr<Q>(), H, D, KVH, H / KVH, BS, block_tables.size(1), static_cast<float>(scale),
                        H * D, H * D, sinks};
  run(p, q.size(0), seq_lens.data_ptr<int64_t>(), sliding_window, portable);
}

// ladder::paged_decode_attention. q [S, H, D] of the cache's dtype, or float32 over a 16-bit cache;
// kv_cache [2, num_blocks, block_size, KVH, D] float32, bfloat16 or float16; block_tables [S, max_blocks]
// and seq_lens [S] int64. Values (block ids, lengths) are the caller's invariant. portable: the portable
// loop even where a vector task exists. sinks: [H] float32, each query head's sink logit, or none. The output
// has q's dtype.
at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& cache_in, const at::Tensor& tables_in,
                                  const at::Tensor& lens_in, double scale, int64_t sliding_window, bool portable,
                                  const std::optional<at::Tensor>& sinks_in) {
  TORCH_CHECK(q_in.device().is_cpu() && cache_in.device().is_cpu() && tables_in.device().is_cpu() &&
              lens_in.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  const auto qt = q_in.scalar_type(), ct = cache_in.scalar_type();
  TORCH_CHECK(qt == ct || qt == at::kFloat, "q of the kv_cache's dtype, or float32");
  TORCH_CHECK(q_in.dim() == 3 && cache_in.dim() == 5 && cache_in.size(0) == 2 && cache_in.size(4) == q_in.size(2) &&
              q_in.size(1) % cache_in.size(3) == 0, "q [S, H, D], kv_cache [2, blocks, block_size, KVH, D]");
  TORCH_CHECK(tables_in.dim() == 2 && tables_in.size(0) == q_in.size(0) && lens_in.numel() == q_in.size(0),
              "block_tables [S, max_blocks], seq_lens [S]");
  const auto q = q_in.contiguous(), kv_cache = cache_in.contiguous();
  const auto block_tables = tables_in.to(at::kLong).contiguous(), seq_lens = lens_in.to(at::kLong).contiguous();
  at::Tensor sinks;
  if (sinks_in.has_value()) {
    TORCH_CHECK(sinks_in->device().is_cpu() && sinks_in->numel() == q_in.size(1),
                "sinks: [H] on the CPU, one per query head");
    sinks = sinks_in->to(at::kFloat).contiguous();
  }
  auto out = at::empty_like(q);
  // One (query, cache) element pair, named by a value of each type.
  auto with = [&](auto q_type, auto cache_type) {
    run_typed<decltype(q_type), decltype(cache_type)>(q, kv_cache, block_tables, seq_lens, out, scale, sliding_window,
                                                      portable, sinks.defined() ? sinks.data_ptr<float>() : nullptr);
  };
  TORCH_CHECK(ct == at::kFloat || ct == at::kBFloat16 || ct == at::kHalf, "float32, bfloat16 or float16 only, got ", ct);
  if (ct == at::kFloat) with(float{}, float{});
  else if (ct == at::kBFloat16 && qt == at::kFloat) with(float{}, c10::BFloat16{});
  else if (ct == at::kBFloat16) with(c10::BFloat16{}, c10::BFloat16{});
  else if (qt == at::kFloat) with(float{}, c10::Half{});
  else with(c10::Half{}, c10::Half{});
  return out;
}

template <typename T>
void rows_over(const float* q, int64_t q_stride, const T* k, const T* v, const int64_t* tables, int64_t max_blocks,
               const int64_t* seq_lens, int64_t S, int64_t H, int64_t KVH, int64_t D, int64_t BS, float scale,
               int64_t window, float* out, int64_t out_stride, const float* sinks) {
  const Problem<float, T> p{q, k, v, tables, out, H, D, KVH, H / KVH, BS, max_blocks, scale, q_stride, out_stride,
                            sinks};
  run(p, S, seq_lens, window, false);
}

}  // namespace

void decode_attention_rows(const float* q, int64_t q_stride, const float* k, const float* v, const int64_t* tables,
                           int64_t max_blocks, const int64_t* seq_lens, int64_t S, int64_t H, int64_t KVH,
                           int64_t D, int64_t BS, float scale, int64_t window, float* out, int64_t out_stride,
                           const float* sinks) {
  rows_over(q, q_stride, k, v, tables, max_blocks, seq_lens, S, H, KVH, D, BS, scale, window, out, out_stride, sinks);
}

void decode_attention_rows(const float* q, int64_t q_stride, const c10::BFloat16* k, const c10::BFloat16* v,
                           const int64_t* tables, int64_t max_blocks, const int64_t* seq_lens, int64_t S, int64_t H,
                           int64_t KVH, int64_t D, int64_t BS, float scale, int64_t window, float* out,
                           int64_t out_stride, const float* sinks) {
  rows_over(q, q_stride, k, v, tables, max_blocks, seq_lens, S, H, KVH, D, BS, scale, window, out, out_stride, sinks);
}

void decode_attention_rows(const float* q, int64_t q_stride, const c10::Half* k, const c10::Half* v,
                           const int64_t* tables, int64_t max_blocks, const int64_t* seq_lens, int64_t S, int64_t H,
                           int64_t KVH, int64_t D, int64_t BS, float scale, int64_t window, float* out,
                           int64_t out_stride, const float* sinks) {
  rows_over(q, q_stride, k, v, tables, max_blocks, seq_lens, S, H, KVH, D, BS, scale, window, out, out_stride, sinks);
}

bool has_avx512() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

}  // namespace ladder

TORCH_LIBRARY_IMPL(ladder, CPU, m) { m.impl("paged_decode_attention", &ladder::paged_decode_attention); }

// Whether this build has the AVX-512 tasks (compiled for this CPU's features).
TORCH_LIBRARY_FRAGMENT(ladder_cpu, m) { m.def("has_avx512() -> bool", &ladder::has_avx512); }
