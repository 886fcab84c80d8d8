// The next token of each row that takes no filter, in one call (engine/sampler.py's common case): a greedy
// row (temperature 0) takes its first maximum, a sampled row one draw from softmax(x / T).
//
// Why one call: a batch-1 decode step streams ~100 MB of weights through the caches, and afterwards each
// distinct torch op pays ~20 us to bring its dispatch code back; the dozen ops of a softmax, a cumulative
// sum and a search cost ~0.3 ms a step that way, 7% of a small model's step. Here each row is read twice
// (its maximum, then its block sums) in parts of 16,384 logits, a task each, so one row of a large
// vocabulary (Gemma 3's 262,144) spreads over the threads; then a short scan per row.
//
// A sampled row, x [V] float32 with temperature T and a uniform number u in [0, 1):
//   z = clamp(x / T, +-FLT_MAX) (as the batched sampler edits logits), m = max z = clamp(max x / T);
//   w_i = exp(z_i - m), 0 where z_i - m < -87 (a weight below 1.7e-38 of the largest: a forbidden token's
//   -inf logit must have no mass at all);
//   the token is the first i whose running sum of w exceeds u * sum(w) (kept below the sum), so it never
//   lands on a zero-weight token.
// The sum runs in blocks of 256 weights (float32 within a block, float64 across blocks); the scan finds
// the block with the same float64 additions, computes that block's weights again and walks them in
// float64, so the chosen token is exact up to float32 rounding of the weights, and depends on nothing but
// the row, its T and its u (not on the batch, nor on how the row was split).
// A row holding a NaN is the model's failure: its token is -1.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "parallel.h"
#include "vec_exp.h"

namespace ladder {
namespace {

constexpr float kFloatMax = std::numeric_limits<float>::max();
constexpr float kFlush = -87.f;  // weights of z - m below this are 0
constexpr int64_t kBlock = 256;  // weights per partial sum
constexpr int64_t kPart = 64 * kBlock;  // logits of one row per task

// The row's maximum, and whether it holds a NaN.
struct RowMax {
  float max;
  bool nan;
};

RowMax row_max(const float* x, int64_t V) {
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#ifdef __AVX512F__
  __m512 vm = _mm512_set1_ps(m);
  __mmask16 unordered = 0;
  for (; i + 16 <= V; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vm = _mm512_max_ps(vm, v);
  }
  m = _mm512_reduce_max_ps(vm);
  nan = unordered != 0;
#elif defined(__AVX2__)
  __m256 vm = _mm256_set1_ps(m);
  __m256 unordered = _mm256_setzero_ps();
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    vm = _mm256_max_ps(vm, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vm);
  for (float l : lanes) m = std::max(m, l);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < V; ++i) {
    nan |= std::isnan(x[i]);
    m = std::max(m, x[i]);
  }
  return {m, nan};
}

// The first i with x[i] == m, or -1.
int64_t first_index_of(const float* x, int64_t V, float m) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 vm = _mm512_set1_ps(m);
  for (; i + 16 <= V; i += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), vm, _CMP_EQ_OQ);
    if (eq) return i + __builtin_ctz(eq);
  }
#elif defined(__AVX2__)
  const __m256 vm = _mm256_set1_ps(m);
  for (; i + 8 <= V; i += 8) {
    const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vm, _CMP_EQ_OQ));
    if (eq) return i + __builtin_ctz(eq);
  }
#endif
  for (; i < V; ++i)
    if (x[i] == m) return i;
  return -1;
}

// The weights of one block x [n] (n <= kBlock, from a block's start) at temperature t with z's maximum m,
// stored in w when STORE; returns their float32 sum. Called for a block twice (its sum, then its weights
// where the draw lands), it computes the same values both times.
template <bool STORE>
float block_weights(const float* x, int64_t n, float t, float m, float* w) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef __AVX512F__
  const __m512 vt = _mm512_set1_ps(t), vm = _mm512_set1_ps(m), lo = _mm512_set1_ps(-kFloatMax),
               hi = _mm512_set1_ps(kFloatMax), flush = _mm512_set1_ps(kFlush);
  __m512 acc = _mm512_setzero_ps();
  for (; i < n; i += 16) {
    const __mmask16 lanes = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 z = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(lanes, x + i), vt), lo), hi);
    const __m512 d = _mm512_sub_ps(z, vm);
    const __m512 e = _mm512_maskz_mov_ps(lanes & _mm512_cmp_ps_mask(d, flush, _CMP_GE_OQ), exp16(d));
    if constexpr (STORE) _mm512_mask_storeu_ps(w + i, lanes, e);
    acc = _mm512_add_ps(acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 vt = _mm256_set1_ps(t), vm = _mm256_set1_ps(m), lo = _mm256_set1_ps(-kFloatMax),
               hi = _mm256_set1_ps(kFloatMax), flush = _mm256_set1_ps(kFlush);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 z = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), vt), lo), hi);
    const __m256 d = _mm256_sub_ps(z, vm);
    const __m256 e = _mm256_and_ps(_mm256_cmp_ps(d, flush, _CMP_GE_OQ), exp8(d));
    if constexpr (STORE) _mm256_storeu_ps(w + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float l : lanes) sum += l;
#endif
  for (; i < n; ++i) {  // the portable loop, and the AVX2 tail
    const float d = std::min(std::max(x[i] / t, -kFloatMax), kFloatMax) - m;
    const float e = d >= kFlush ? std::exp(d) : 0.f;
    if constexpr (STORE) w[i] = e;
    sum += e;
  }
  return sum;
}

// One draw from the row x [V] at temperature t (z's maximum m), its block sums `sums`, uniform u in [0, 1).
int64_t draw(const float* x, int64_t V, float t, float m, const float* sums, double u) {
  const int64_t blocks = (V + kBlock - 1) / kBlock;
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) total += sums[b];
  double target = u * total;
  if (!(target < total)) target = std::nextafter(total, 0.0);
  double prefix = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const double next = prefix + sums[b];  // the additions of `total`: the last block with mass ends at it
    if (next > target) {
      const int64_t b0 = b * kBlock, n = std::min(V - b0, kBlock);
      float w[kBlock];
      block_weights<true>(x + b0, n, t, m, w);
      double run = prefix;
      for (int64_t i = 0; i < n; ++i) {
        run += w[i];
        if (run > target) return b0 + i;  // w[i] > 0: the running sum grew past the target here
      }
      for (int64_t i = n - 1; i > 0; --i)  // float32 block sum above the float64 walk: its last token
        if (w[i] > 0.f) return b0 + i;
      return b0;
    }
    prefix = next;
  }
  return V - 1;  // not reached: the last block with mass ends at the total, above the target
}

// ladder::sample_rows: logits [B, V] float32 (rows contiguous), temperature [B] (0: greedy), uniform [B]
// in [0, 1) -> [B] int64 token ids, -1 for a row with a NaN. A temperature below float32's smallest normal
// number is greedy too (x / T would overflow every logit).
at::Tensor sample_rows(const at::Tensor& logits, c10::ArrayRef<double> temperature, c10::ArrayRef<double> uniform) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
              logits.stride(1) == 1, "logits: [B, V] float32 CPU, rows contiguous");
  const int64_t B = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(static_cast<int64_t>(temperature.size()) == B && static_cast<int64_t>(uniform.size()) == B,
              "one temperature and one uniform number per row");
  TORCH_CHECK(V > 0, "an empty vocabulary");
  for (int64_t r = 0; r < B; ++r) {
    TORCH_CHECK(temperature[r] >= 0.0 && std::isfinite(temperature[r]), "temperature must be finite and >= 0");
    TORCH_CHECK(uniform[r] >= 0.0 && uniform[r] < 1.0, "uniform numbers lie in [0, 1)");
  }
  auto out = at::empty({B}, logits.options().dtype(at::kLong));
  const float* xp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  // Each row in parts of kPart logits, a task each, so that one row's work spreads over the threads (the
  // parts' maxima, first maximum and block sums do not depend on the split).
  const int64_t parts = (V + kPart - 1) / kPart, blocks = (V + kBlock - 1) / kBlock;
  auto part_of = [&](int64_t task) {
    const int64_t r = task / parts, p0 = (task % parts) * kPart;
    return std::make_tuple(r, xp + r * stride + p0, p0, std::min(kPart, V - p0));
  };
  std::vector<RowMax> part_max(B * parts);
  parallel_for(0, B * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const auto [r, x, p0, n] = part_of(task);
      part_max[task] = row_max(x, n);
    }
  });
  std::vector<RowMax> row(B);
  std::vector<float> t(B), m(B);
  for (int64_t r = 0; r < B; ++r) {
    row[r] = part_max[r * parts];
    for (int64_t q = 1; q < parts; ++q) {
      row[r].max = std::max(row[r].max, part_max[r * parts + q].max);
      row[r].nan |= part_max[r * parts + q].nan;
    }
    t[r] = static_cast<float>(temperature[r]);
  }
  auto greedy = [&](int64_t r) { return !(t[r] >= std::numeric_limits<float>::min()); };  // 0, or too small
  for (int64_t r = 0; r < B; ++r) m[r] = greedy(r) ? 0.f : std::min(std::max(row[r].max / t[r], -kFloatMax), kFloatMax);
  std::vector<int64_t> first(B * parts, -1);
  std::vector<float> sums(B * blocks);
  parallel_for(0, B * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const auto [r, x, p0, n] = part_of(task);
      if (row[r].nan) continue;
      if (greedy(r)) {
        const int64_t i = first_index_of(x, n, row[r].max);
        first[task] = i < 0 ? -1 : p0 + i;
        continue;
      }
      for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
        const float sum = block_weights<false>(x + b0, std::min(kBlock, n - b0), t[r], m[r], nullptr);
        sums[r * blocks + (p0 + b0) / kBlock] = sum;
      }
    }
  });
  parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (row[r].nan) {
        op[r] = -1;
      } else if (greedy(r)) {
        const auto found = std::find_if(first.begin() + r * parts, first.begin() + (r + 1) * parts,
                                        [](int64_t i) { return i >= 0; });  // the first part holding the max
        op[r] = found == first.begin() + (r + 1) * parts ? 0 : *found;
      } else {
        op[r] = draw(xp + r * stride, V, t[r], m[r], sums.data() + r * blocks, uniform[r]);
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace ladder

TORCH_LIBRARY_IMPL(ladder, CPU, m) { m.impl("sample_rows", &ladder::sample_rows); }
