// RMSNorm (with the residual add) and the rotary embedding for float32 rows, each one call that reads its
// inputs once. Every row (token) is computed alone, in the same order whatever the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace ladder {
namespace {

// out[d] = w[d] * (x[d] * rsqrt(mean(x^2) + eps)) for one row of D floats.
inline void rms_row(const float* __restrict x, const float* __restrict w, float eps, int64_t D,
                           float* __restrict out) {
  int64_t d = 0;
  float ss = 0.f;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= D; d += 16) {
    const __m512 v = _mm512_loadu_ps(x + d);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  ss = _mm512_reduce_add_ps(acc);
#endif
  for (; d < D; ++d) ss += x[d] * x[d];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
  d = 0;
#ifdef __AVX512F__
  const __m512 vr = _mm512_set1_ps(r);
  for (; d + 16 <= D; d += 16)
    _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_loadu_ps(w + d), _mm512_mul_ps(_mm512_loadu_ps(x + d), vr)));
#endif
  for (; d < D; ++d) out[d] = w[d] * (x[d] * r);
}

void check_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.size(-1) == w.numel(), "x [..., D] contiguous, weight [D]");
}

// ladder::rms_norm: x [..., D] float32 contiguous -> rms_norm(x) * weight.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w);
  auto out = at::empty_like(x);
  const int64_t D = x.size(-1), rows = D ? x.numel() / D : 0;
  const float* xp = x.data_ptr<float>(); const float* wp = w.data_ptr<float>(); float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(D, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_row(xp + r * D, wp, static_cast<float>(eps), D, op + r * D);
  });
  return out;
}

// ladder::fused_add_rms_norm: (rms_norm(x + residual) * weight, x + residual).
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                       const at::Tensor& w, double eps) {
  check_rows(x, w);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == at::kFloat && residual.is_contiguous() &&
              residual.device().is_cpu(), "residual: x's shape, float32, contiguous");
  auto sum = at::empty_like(x);
  auto out = at::empty_like(x);
  const int64_t D = x.size(-1), rows = D ? x.numel() / D : 0;
  const float* xp = x.data_ptr<float>(); const float* rp = residual.data_ptr<float>(); const float* wp = w.data_ptr<float>();
  float* sp = sum.data_ptr<float>(); float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(D, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t d = 0; d < D; ++d) sp[r * D + d] = xp[r * D + d] + rp[r * D + d];
      rms_row(sp + r * D, wp, static_cast<float>(eps), D, op + r * D);
    }
  });
  return {out, sum};
}

// In place: x [T, H, D] (last dim contiguous, any token/head strides) rotated by cos, sin [T, D/2]:
// (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), halves of the head.
void rotate_(at::Tensor& x, const float* cp, const float* sp, int64_t half) {
  const int64_t T = x.size(0), H = x.size(1), st = x.stride(0), sh = x.stride(1);
  float* xp = x.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 4096 / std::max<int64_t>(H * half, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < H; ++h) {
        float* row = xp + t * st + h * sh;
        const float* c = cp + t * half; const float* s = sp + t * half;
        for (int64_t i = 0; i < half; ++i) {
          const float a = row[i], b = row[i + half];
          row[i] = a * c[i] - b * s[i];
          row[i + half] = b * c[i] + a * s[i];
        }
      }
  });
}

void rotary(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  for (auto* x : {&q, &k}) {
    TORCH_CHECK(x->device().is_cpu() && x->scalar_type() == at::kFloat && x->dim() == 3 && x->stride(2) == 1,
                "q, k: [T, heads, head_dim] float32 CPU, head_dim contiguous");
  }
  const int64_t half = q.size(2) / 2;
  TORCH_CHECK(q.size(2) == 2 * half && k.size(2) == q.size(2) && k.size(0) == q.size(0), "q, k: same T and even head_dim");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == q.size(0) && cos.size(1) == half &&
              sin.sizes() == cos.sizes(), "cos, sin: [T, head_dim / 2] float32 contiguous");
  rotate_(q, cos.data_ptr<float>(), sin.data_ptr<float>(), half);
  rotate_(k, cos.data_ptr<float>(), sin.data_ptr<float>(), half);
}

}  // namespace
}  // namespace ladder

TORCH_LIBRARY_IMPL(ladder, CPU, m) {
  m.impl("rms_norm", &ladder::rms_norm);
  m.impl("fused_add_rms_norm", &ladder::fused_add_rms_norm);
  m.impl("rotary", &ladder::rotary);
}
