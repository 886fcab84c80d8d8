// Batched multi-LoRA (Punica's BGMV) for float32 rows: out = y, plus for every row t with a slot
// s = rows[t] >= 0, (x[t] @ a[s].T) @ b[s] (a [S, R, K], b [S, R, N], the rank-R product in float32).
// With `splits` (P + 1 column bounds 0 = c_0 < ... < c_P = N, R divisible by P; empty: one part), the
// columns c_p .. c_{p+1} take only the ranks of part p, p * R / P .. (p + 1) * R / P: b's entries outside
// their part's columns are never read (a fused q/k/v projection's block-diagonal b, its zeros skipped).
//
// Rows are grouped by slot (a counting sort), so that one slot's a and b are read once per call however
// many rows share it, and the work is cut into units that threads share: one slot's rows (at most
// kRowsPerUnit) by a block of ranks for the shrink, by a block of output columns for the expand, whose
// weights stay in cache while the unit's rows pass over them. Every element is computed by one fixed
// sequence of operations whatever the unit, tile, batch or thread, so a row's result depends on its own
// x, y and slot alone:
//   shrink  h[t, r] = hsum8(acc): lane l of acc is the fma chain, from 0, over k = l, l + 8, ... in
//           order (lanes past K multiply zeros), and hsum8(v) = ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7));
//   expand  out[t, n] = y[t, n] + (the fma chain, from 0, over the ranks r of n's part in order of
//           h[t, r] * b[s, r, n]).
// The AVX2 tiles (8 float lanes, also what an AVX-512 CPU runs) and the portable loop both compute
// exactly that, so they agree bit for bit. Rows without a slot are copied.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"
#include "parallel.h"
#include "tile.h"

#if defined(__AVX2__) && defined(__FMA__)
#define LADDER_LORA_AVX2 1
#endif

namespace ladder {
namespace {

constexpr int64_t kLanes = 8;          // the lanes of the fixed order above
constexpr int64_t kRowsPerUnit = 32;   // rows of one slot per unit of work
constexpr int64_t kRanksPerUnit = 8;   // shrink: 8 rows of a (K floats each) per unit
constexpr int64_t kColsPerUnit = 192;  // expand: 24 vectors, whole tiles of 3, 4, 6 and 8 vectors
constexpr int64_t kMinWork = 65536;    // multiply-adds a thread takes at least (tiny calls stay on one)

inline float hsum8(const float* v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

// One unit of work: positions p0 .. p1 of the rows grouped by slot (all of one slot, or all without
// one: slot -1), by ranks (shrink) or columns (expand) c0 .. c1; an expand unit's columns lie in one
// part, whose ranks are r0 .. r1.
struct Unit {
  int64_t slot, p0, p1, c0, c1, r0 = 0, r1 = 0;
};

// What a call works on. `order` lists the rows grouped by slot; h [T, R] holds the shrink of the row
// at position p in row p.
struct Problem {
  const float *x, *y, *a, *b;
  float *out, *h;
  const int64_t* order;
  int64_t K, N, R;
};

// --- The portable loop: the fixed order, one row and one rank (shrink) or column run (expand) at a time.

float shrink_dot_portable(const float* x, const float* a, int64_t K) {
  float acc[kLanes] = {};
  int64_t k0 = 0;
  for (; k0 + kLanes <= K; k0 += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) acc[l] = std::fma(x[k0 + l], a[k0 + l], acc[l]);
  if (k0 < K)  // the masked lanes multiply zeros, as the tiles' masked loads do
    for (int64_t l = 0; l < kLanes; ++l)
      acc[l] = k0 + l < K ? std::fma(x[k0 + l], a[k0 + l], acc[l]) : std::fma(0.f, 0.f, acc[l]);
  return hsum8(acc);
}

void shrink_unit_portable(const Problem& q, const Unit& u) {
  const float* as = q.a + u.slot * q.R * q.K;
  for (int64_t p = u.p0; p < u.p1; ++p) {
    const float* x = q.x + q.order[p] * q.K;
    for (int64_t r = u.c0; r < u.c1; ++r) q.h[p * q.R + r] = shrink_dot_portable(x, as + r * q.K, q.K);
  }
}

void expand_unit_portable(const Problem& q, const Unit& u) {
  constexpr int64_t kRun = 64;  // columns whose sums are carried together over the ranks
  const float* bs = q.b + u.slot * q.R * q.N;
  for (int64_t p = u.p0; p < u.p1; ++p) {
    const int64_t t = q.order[p];
    const float* h = q.h + p * q.R;
    for (int64_t c = u.c0; c < u.c1; c += kRun) {
      const int64_t width = std::min(kRun, u.c1 - c);
      float acc[kRun] = {};
      for (int64_t r = u.r0; r < u.r1; ++r)
        for (int64_t l = 0; l < width; ++l) acc[l] = std::fma(h[r], bs[r * q.N + c + l], acc[l]);
      for (int64_t l = 0; l < width; ++l) q.out[t * q.N + c + l] = q.y[t * q.N + c + l] + acc[l];
    }
  }
}

#ifdef LADDER_LORA_AVX2
// --- The AVX2 tiles: MR rows at once (one slot), each row's sums in their own registers.

inline __m256i lane_mask(int64_t left) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(std::min<int64_t>(left, kLanes))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline float hsum8(__m256 v) {  // the portable hsum8's order: lanes l and l + 4, then l and l + 2, then the two
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Shrink: MR rows of x (xr) by RR consecutive rows of a (from `a`, K apart) over all of K; h of row i,
// rank j at hr[i][j]. MR * RR accumulators, each row of a loaded once per 8 columns for all MR rows.
struct ShrinkTiles {
  using Fn = void (*)(const float* const*, const float*, int64_t, float* const*);
  static constexpr int kMaxMr = 4;
  static constexpr int kMaxNb[kMaxMr + 1] = {0, 8, 4, 2, 2};  // ranks per tile of so many rows

  template <int MR, int RR>
  static void tile(const float* const* xr, const float* __restrict a, int64_t K, float* const* hr) {
    const float* __restrict xp[MR];
    __m256 acc[MR][RR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      xp[i] = xr[i];
#pragma GCC unroll 8
      for (int j = 0; j < RR; ++j) acc[i][j] = _mm256_setzero_ps();
    }
    int64_t k = 0;
    for (; k + kLanes <= K; k += kLanes) {
      __m256 av[RR];
#pragma GCC unroll 8
      for (int j = 0; j < RR; ++j) {
        av[j] = _mm256_loadu_ps(a + j * K + k);
        // Kept in a register where the 16 hold it beside the sums and a row of x (else loaded MR times).
        if constexpr (MR * RR + RR + 1 <= 16) asm("" : "+x"(av[j]));
      }
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        __m256 xv = _mm256_loadu_ps(xp[i] + k);
        asm("" : "+x"(xv));  // one load for the RR fmas
#pragma GCC unroll 8
        for (int j = 0; j < RR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, av[j], acc[i][j]);
      }
    }
    if (k < K) {  // the last, partial 8 columns: masked lanes load zeros
      const __m256i mask = lane_mask(K - k);
      __m256 av[RR];
#pragma GCC unroll 8
      for (int j = 0; j < RR; ++j) av[j] = _mm256_maskload_ps(a + j * K + k, mask);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m256 xv = _mm256_maskload_ps(xp[i] + k, mask);
#pragma GCC unroll 8
        for (int j = 0; j < RR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, av[j], acc[i][j]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < RR; ++j) hr[i][j] = hsum8(acc[i][j]);
  }
};

// Expand: MR rows (their h, y and out rows) by NV whole vectors of columns from column c, over all R
// ranks; `b` is the slot's b at column c, ldb floats from one rank to the next. MR * NV accumulators;
// each vector of b loaded once per rank for all MR rows.
struct ExpandTiles {
  using Fn = void (*)(const float* const*, const float*, int64_t, int64_t, const float* const*, float* const*,
                      int64_t);
  static constexpr int kMaxMr = 4;
  static constexpr int kMaxNb[kMaxMr + 1] = {0, 8, 6, 4, 3};  // vectors per tile of so many rows

  template <int MR, int NV>
  static void tile(const float* const* hr, const float* __restrict b, int64_t ldb, int64_t R, const float* const* yr,
                   float* const* outr, int64_t c) {
    const float* __restrict hp[MR];
    __m256 acc[MR][NV];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      hp[i] = hr[i];
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_setzero_ps();
    }
    for (int64_t r = 0; r < R; ++r, b += ldb) {
      __m256 bv[NV];
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) {
        bv[v] = _mm256_loadu_ps(b + v * kLanes);
        // Kept in a register where the 16 hold it beside the sums and a broadcast (else loaded MR times).
        if constexpr (MR * NV + NV + 1 <= 16) asm("" : "+x"(bv[v]));
      }
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m256 hv = _mm256_broadcast_ss(hp[i] + r);
#pragma GCC unroll 8
        for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_fmadd_ps(hv, bv[v], acc[i][v]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const float* __restrict yp = yr[i] + c;
      float* __restrict op = outr[i] + c;
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v)
        _mm256_storeu_ps(op + v * kLanes, _mm256_add_ps(_mm256_loadu_ps(yp + v * kLanes), acc[i][v]));
    }
  }
};

// The columns c .. c + left (left < 8) of mr rows: the tile's arithmetic with masked loads and stores.
void expand_tail(int mr, const float* const* hr, const float* b, int64_t ldb, int64_t R, const float* const* yr,
                 float* const* outr, int64_t c, int64_t left) {
  const __m256i mask = lane_mask(left);
  for (int i = 0; i < mr; ++i) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t r = 0; r < R; ++r)
      acc = _mm256_fmadd_ps(_mm256_broadcast_ss(hr[i] + r), _mm256_maskload_ps(b + r * ldb, mask), acc);
    _mm256_maskstore_ps(outr[i] + c, mask, _mm256_add_ps(_mm256_maskload_ps(yr[i] + c, mask), acc));
  }
}

void shrink_unit(const Problem& q, const Unit& u) {
  const float* as = q.a + u.slot * q.R * q.K;
  for (int64_t p = u.p0; p < u.p1;) {
    const int mr = static_cast<int>(std::min<int64_t>(ShrinkTiles::kMaxMr, u.p1 - p));
    const float* xr[ShrinkTiles::kMaxMr];
    float* hr[ShrinkTiles::kMaxMr];
    for (int i = 0; i < mr; ++i) xr[i] = q.x + q.order[p + i] * q.K;
    for (int64_t r = u.c0; r < u.c1;) {
      const int rr = static_cast<int>(std::min<int64_t>(ShrinkTiles::kMaxNb[mr], u.c1 - r));
      for (int i = 0; i < mr; ++i) hr[i] = q.h + (p + i) * q.R + r;
      pick<ShrinkTiles>(mr, rr)(xr, as + r * q.K, q.K, hr);
      r += rr;
    }
    p += mr;
  }
}

// A unit of many rows first copies its block of b ([r1 - r0, c1 - c0]) together: rows of b N floats
// apart share L1 sets when N * 4 is a multiple of 4 KiB (gate_up's 3072) and would evict each other.
void expand_unit(const Problem& q, const Unit& u) {
  constexpr int64_t kPackRows = 8;
  const int64_t width = u.c1 - u.c0, ranks = u.r1 - u.r0;
  const float* b = q.b + (u.slot * q.R + u.r0) * q.N + u.c0;
  int64_t ldb = q.N;
  thread_local std::vector<float> packed;
  if (u.p1 - u.p0 >= kPackRows) {
    packed.resize(ranks * width);
    for (int64_t r = 0; r < ranks; ++r) std::memcpy(packed.data() + r * width, b + r * q.N, width * sizeof(float));
    b = packed.data();
    ldb = width;
  }
  const int64_t whole = width / kLanes * kLanes;
  for (int64_t p = u.p0; p < u.p1;) {
    const int mr = static_cast<int>(std::min<int64_t>(ExpandTiles::kMaxMr, u.p1 - p));
    const float* hr[ExpandTiles::kMaxMr];
    const float* yr[ExpandTiles::kMaxMr];
    float* outr[ExpandTiles::kMaxMr];
    for (int i = 0; i < mr; ++i) {
      const int64_t t = q.order[p + i];
      hr[i] = q.h + (p + i) * q.R + u.r0;
      yr[i] = q.y + t * q.N;
      outr[i] = q.out + t * q.N;
    }
    int64_t c = 0;  // from u.c0
    while (c < whole) {
      const int nv = static_cast<int>(std::min<int64_t>(ExpandTiles::kMaxNb[mr], (whole - c) / kLanes));
      pick<ExpandTiles>(mr, nv)(hr, b + c, ldb, ranks, yr, outr, u.c0 + c);
      c += nv * kLanes;
    }
    if (c < width) expand_tail(mr, hr, b + c, ldb, ranks, yr, outr, u.c0 + c, width - c);
    p += mr;
  }
}
#endif

void copy_unit(const Problem& q, const Unit& u) {
  for (int64_t p = u.p0; p < u.p1; ++p) {
    const int64_t t = q.order[p];
    std::memcpy(q.out + t * q.N + u.c0, q.y + t * q.N + u.c0, (u.c1 - u.c0) * sizeof(float));
  }
}

// Runs every unit, threads taking whole runs of units of at least kMinWork multiply-adds in all.
template <class Run>
void run_units(const std::vector<Unit>& units, int64_t total_work, const Run& run) {
  const int64_t count = static_cast<int64_t>(units.size());
  if (count == 0) return;
  const int64_t per_unit = std::max<int64_t>(1, total_work / count);
  parallel_for(0, count, std::max<int64_t>(1, (kMinWork + per_unit - 1) / per_unit), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) run(units[i]);
  });
}

void check_matrix(const at::Tensor& t, int64_t dim, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == dim && t.is_contiguous(), what,
              " float32 contiguous CPU");
}

}  // namespace

std::vector<int64_t> lora_bounds(c10::IntArrayRef splits, int64_t N, int64_t R) {
  std::vector<int64_t> bounds(splits.begin(), splits.end());
  if (bounds.empty()) bounds = {0, N};
  const int64_t P = static_cast<int64_t>(bounds.size()) - 1;
  TORCH_CHECK_VALUE(P >= 1 && bounds.front() == 0 && bounds.back() == N, "lora_add: splits must run from 0 to N = ",
                    N, ", got ", splits);
  for (int64_t p = 0; p < P; ++p)
    TORCH_CHECK_VALUE(bounds[p] < bounds[p + 1], "lora_add: splits must be strictly increasing, got ", splits);
  TORCH_CHECK_VALUE(R % P == 0, "lora_add: the rank R = ", R, " must be divisible by the number of parts P = ", P);
  return bounds;
}

void lora_add_rows(const float* y, const float* x, const float* a, const float* b, const int64_t* slot, int64_t T,
                   int64_t K, int64_t N, int64_t S, int64_t R, const int64_t* bounds, int64_t P, float* out,
                   bool portable) {
  const int64_t part_ranks = R / P;  // part p: columns bounds[p] .. bounds[p + 1], ranks p * part_ranks ..
#ifndef LADDER_LORA_AVX2
  (void)portable;  // the portable loop is all there is
#endif
  // Group the rows by slot: bucket s for slot s, bucket S for the rows without one; stable.
  std::vector<int64_t> start(S + 2, 0), order(T);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK_VALUE(slot[t] >= -1 && slot[t] < S, "rows[", t, "] = ", slot[t], " is not a slot in -1 .. ", S - 1);
    ++start[(slot[t] < 0 ? S : slot[t]) + 1];
  }
  for (int64_t s = 0; s <= S; ++s) start[s + 1] += start[s];
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t t = 0; t < T; ++t) order[next[slot[t] < 0 ? S : slot[t]]++] = t;
  }
  std::vector<float> h(T * R);
  const Problem q{x, y, a, b, out, h.data(), order.data(), K, N, R};

  std::vector<Unit> shrink, expand;
  for (int64_t s = 0; s <= S; ++s)
    for (int64_t p = start[s]; p < start[s + 1]; p += kRowsPerUnit) {
      const int64_t p1 = std::min(p + kRowsPerUnit, start[s + 1]), bucket = s < S ? s : -1;
      if (bucket >= 0)
        for (int64_t r = 0; r < R; r += kRanksPerUnit)
          shrink.push_back({bucket, p, p1, r, std::min(r + kRanksPerUnit, R)});
      if (bucket < 0) {
        for (int64_t c = 0; c < N; c += kColsPerUnit)
          expand.push_back({bucket, p, p1, c, std::min(c + kColsPerUnit, N)});
        continue;
      }
      for (int64_t part = 0; part < P; ++part)  // units inside one part: its columns, its ranks
        for (int64_t c = bounds[part]; c < bounds[part + 1]; c += kColsPerUnit)
          expand.push_back({bucket, p, p1, c, std::min(c + kColsPerUnit, bounds[part + 1]), part * part_ranks,
                            (part + 1) * part_ranks});
    }
  const int64_t with_slot = start[S];
  run_units(shrink, with_slot * R * K, [&](const Unit& u) {
#ifdef LADDER_LORA_AVX2
    if (!portable) return shrink_unit(q, u);
#endif
    shrink_unit_portable(q, u);
  });
  run_units(expand, with_slot * part_ranks * N + (T - with_slot) * N, [&](const Unit& u) {
    if (u.slot < 0) return copy_unit(q, u);
#ifdef LADDER_LORA_AVX2
    if (!portable) return expand_unit(q, u);
#endif
    expand_unit_portable(q, u);
  });
}

namespace {

// ladder::lora_add: y [T, N], x [T, K], a [S, R, K], b [S, R, N] float32, rows [T] int64 in -1 .. S - 1,
// splits empty or the P + 1 column bounds of the parts (top of the file).
// `portable`: the portable loop even where the AVX2 tiles exist (tests; the results are the same).
at::Tensor lora_add(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                    const at::Tensor& rows, c10::IntArrayRef splits, bool portable) {
  check_matrix(y, 2, "y: [T, N]");
  check_matrix(x, 2, "x: [T, K]");
  check_matrix(a, 3, "a: [S, R, K]");
  check_matrix(b, 3, "b: [S, R, N]");
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "rows: [T] int64 contiguous CPU");
  const int64_t T = y.size(0), N = y.size(1), K = x.size(1), S = a.size(0), R = a.size(1);
  TORCH_CHECK(x.size(0) == T && rows.size(0) == T && a.size(2) == K && b.size(0) == S && b.size(1) == R &&
              b.size(2) == N, "lora_add: shapes y [T, N], x [T, K], a [S, R, K], b [S, R, N], rows [T] do not agree");
  const std::vector<int64_t> bounds = lora_bounds(splits, N, R);
  auto out = at::empty_like(y);
  lora_add_rows(y.data_ptr<float>(), x.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(),
                rows.data_ptr<int64_t>(), T, K, N, S, R, bounds.data(), static_cast<int64_t>(bounds.size()) - 1,
                out.data_ptr<float>(), portable);
  return out;
}

}  // namespace
}  // namespace ladder

TORCH_LIBRARY_IMPL(ladder, CPU, m) { m.impl("lora_add", &ladder::lora_add); }
