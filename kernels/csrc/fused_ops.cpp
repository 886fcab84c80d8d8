// RMSNorm (with the residual add), the rotary embedding and SiLU (GELU) x up for float32 rows, each one call that
// reads its inputs once. Every row (token) is computed alone, in the same order whatever the batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>

#include "cpu_kernels.h"
#include "parallel.h"
#include "vec_exp.h"

namespace ladder {

void rms_norm_row(const float* __restrict x, const float* __restrict w, float eps, int64_t D, float* __restrict out) {
  int64_t d = 0;
  float ss = 0.f;
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= D; d += 16) {
    const __m512 v = _mm512_loadu_ps(x + d);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  ss = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  // 8 lanes of squares (the scalar loop below is one chain of dependent additions: 2 us a row of 576).
  __m256 acc = _mm256_setzero_ps();
  for (; d + 8 <= D; d += 8) {
    const __m256 v = _mm256_loadu_ps(x + d);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float l : lanes) ss += l;
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

void add_rms_norm_row(const float* x, const float* residual, const float* w, float eps, int64_t D, float* sum,
                      float* out) {
  for (int64_t d = 0; d < D; ++d) sum[d] = x[d] + residual[d];
  rms_norm_row(sum, w, eps, D, out);
}

void rotate_rows(float* x, int64_t T, int64_t H, int64_t token_stride, int64_t head_stride, const float* cos,
                 const float* sin, int64_t half) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      float* row = x + t * token_stride + h * head_stride;
      const float* c = cos + t * half;
      const float* s = sin + t * half;
      for (int64_t i = 0; i < half; ++i) {
        const float a = row[i], b = row[i + half];
        row[i] = a * c[i] - b * s[i];
        row[i + half] = b * c[i] + a * s[i];
      }
    }
}

#ifdef __AVX512F__
namespace {
// act(g) * u, 16 lanes: silu(g) = g / (1 + exp(-g)); gelu's tanh form 0.5 g (1 + tanh(a)) with a =
// sqrt(2 / pi) (g + 0.044715 g^3) is the same shape, g / (1 + exp(-2a)), which keeps its precision where
// 1 + tanh(a) cancels (large negative g).
template <bool GELU>
inline __m512 gated16(__m512 g, __m512 u) {
  __m512 z = _mm512_sub_ps(_mm512_setzero_ps(), g);
  if constexpr (GELU) {
    const __m512 inner = _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(0.044715f), _mm512_mul_ps(g, _mm512_mul_ps(g, g))));
    z = _mm512_mul_ps(_mm512_set1_ps(-1.5957691216057308f), inner);
  }
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(z))), u);
}
}  // namespace
#elif defined(__AVX2__) && defined(__FMA__)
namespace {
template <bool GELU>
inline __m256 gated8(__m256 g, __m256 u) {
  __m256 z = _mm256_sub_ps(_mm256_setzero_ps(), g);
  if constexpr (GELU) {
    const __m256 inner = _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(0.044715f), _mm256_mul_ps(g, _mm256_mul_ps(g, g))));
    z = _mm256_mul_ps(_mm256_set1_ps(-1.5957691216057308f), inner);
  }
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(z))), u);
}
}  // namespace
#endif

template <bool GELU>
void gated_rows(const float* gate_up, int64_t T, int64_t I, float* out) {
  for (int64_t t = 0; t < T; ++t) {
    const float* g = gate_up + t * 2 * I;
    const float* u = g + I;
    float* o = out + t * I;
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= I; i += 16) _mm512_storeu_ps(o + i, gated16<GELU>(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
    if (i < I) {  // the tail through the same lanes' arithmetic
      const __mmask16 m = static_cast<__mmask16>((1u << (I - i)) - 1u);
      _mm512_mask_storeu_ps(o + i, m, gated16<GELU>(_mm512_maskz_loadu_ps(m, g + i), _mm512_maskz_loadu_ps(m, u + i)));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= I; i += 8) _mm256_storeu_ps(o + i, gated8<GELU>(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    if (i < I) {  // the tail through the same lanes' arithmetic
      const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(I - i)),
                                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      _mm256_maskstore_ps(o + i, m, gated8<GELU>(_mm256_maskload_ps(g + i, m), _mm256_maskload_ps(u + i, m)));
    }
#else
    for (; i < I; ++i) {
      const float z = GELU ? -1.5957691216057308f * (g[i] + 0.044715f * (g[i] * (g[i] * g[i]))) : -g[i];
      o[i] = g[i] / (1.f + std::exp(z)) * u[i];
    }
#endif
  }
}

void sigmoid_gate_rows(float* out, const float* gate, int64_t T, int64_t n, int64_t gate_stride) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < n; ++j) out[t * n + j] *= 1.f / (1.f + std::exp(-gate[t * gate_stride + j]));
}

void silu_and_mul_rows(const float* gate_up, int64_t T, int64_t I, float* out) { gated_rows<false>(gate_up, T, I, out); }

// GPT-OSS's experts: g = min(gate, limit), u = clamp(up, -limit, limit); g / (1 + exp(-alpha g)) * (u + 1), on the
// lanes of gated_rows' exp.
void clamped_swiglu_rows(const float* gate_up, int64_t T, int64_t I, float alpha, float limit, float* out) {
  for (int64_t t = 0; t < T; ++t) {
    const float* g = gate_up + t * 2 * I;
    const float* u = g + I;
    float* o = out + t * I;
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 lim = _mm512_set1_ps(limit), neg = _mm512_set1_ps(-limit), a = _mm512_set1_ps(-alpha);
    const __m512 one = _mm512_set1_ps(1.f);
    auto lanes = [&](__m512 gv, __m512 uv) {
      gv = _mm512_min_ps(lim, gv);  // (the second operand when either is NaN: a NaN stays one, as torch's)
      uv = _mm512_add_ps(_mm512_max_ps(neg, _mm512_min_ps(lim, uv)), one);
      return _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, exp16(_mm512_mul_ps(a, gv)))), uv);
    };
    for (; i + 16 <= I; i += 16) _mm512_storeu_ps(o + i, lanes(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i)));
    if (i < I) {
      const __mmask16 m = static_cast<__mmask16>((1u << (I - i)) - 1u);
      _mm512_mask_storeu_ps(o + i, m, lanes(_mm512_maskz_loadu_ps(m, g + i), _mm512_maskz_loadu_ps(m, u + i)));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 lim = _mm256_set1_ps(limit), neg = _mm256_set1_ps(-limit), a = _mm256_set1_ps(-alpha);
    const __m256 one = _mm256_set1_ps(1.f);
    auto lanes = [&](__m256 gv, __m256 uv) {
      gv = _mm256_min_ps(lim, gv);  // (the second operand when either is NaN: a NaN stays one, as torch's)
      uv = _mm256_add_ps(_mm256_max_ps(neg, _mm256_min_ps(lim, uv)), one);
      return _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_mul_ps(a, gv)))), uv);
    };
    for (; i + 8 <= I; i += 8) _mm256_storeu_ps(o + i, lanes(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    if (i < I) {
      const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(I - i)),
                                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      _mm256_maskstore_ps(o + i, m, lanes(_mm256_maskload_ps(g + i, m), _mm256_maskload_ps(u + i, m)));
    }
#else
    for (; i < I; ++i) {
      const float gv = std::min(g[i], limit), uv = std::max(std::min(u[i], limit), -limit) + 1.f;
      o[i] = gv / (1.f + std::exp(-alpha * gv)) * uv;
    }
#endif
  }
}

void gelu_tanh_and_mul_rows(const float* gate_up, int64_t T, int64_t I, float* out) {
  gated_rows<true>(gate_up, T, I, out);
}

namespace {

void check_norm_inputs(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.size(-1) == w.numel(), "x [..., D] contiguous, weight [D]");
}

// Rows per task: about 32 K floats of work each, so small batches stay on one thread.
int64_t row_grain(int64_t D) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(D, 1)); }

// ladder::rms_norm: x [..., D] float32 contiguous -> rms_norm(x) * weight.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_norm_inputs(x, w);
  auto out = at::empty_like(x);
  const int64_t D = x.size(-1), rows = D ? x.numel() / D : 0;
  const float* xp = x.data_ptr<float>(); const float* wp = w.data_ptr<float>(); float* op = out.data_ptr<float>();
  parallel_for(0, rows, row_grain(D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_norm_row(xp + r * D, wp, static_cast<float>(eps), D, op + r * D);
  });
  return out;
}

// ladder::fused_add_rms_norm: (rms_norm(x + residual) * weight, x + residual).
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                       const at::Tensor& w, double eps) {
  check_norm_inputs(x, w);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == at::kFloat && residual.is_contiguous() &&
              residual.device().is_cpu(), "residual: x's shape, float32, contiguous");
  auto sum = at::empty_like(x);
  auto out = at::empty_like(x);
  const int64_t D = x.size(-1), rows = D ? x.numel() / D : 0;
  const float* xp = x.data_ptr<float>(); const float* rp = residual.data_ptr<float>(); const float* wp = w.data_ptr<float>();
  float* sp = sum.data_ptr<float>(); float* op = out.data_ptr<float>();
  parallel_for(0, rows, row_grain(D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      add_rms_norm_row(xp + r * D, rp + r * D, wp, static_cast<float>(eps), D, sp + r * D, op + r * D);
  });
  return {out, sum};
}

// ladder::rotary, in place: q [T, Hq, D], k [T, Hk, D] (last dim contiguous, any token/head strides) rotated
// by cos, sin [T, D/2].
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
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  for (auto* x : {&q, &k}) {
    const int64_t H = x->size(1), st = x->stride(0), sh = x->stride(1);
    float* xp = x->data_ptr<float>();
    parallel_for(0, x->size(0), std::max<int64_t>(1, 4096 / std::max<int64_t>(H * half, 1)), [&](int64_t t0, int64_t t1) {
      rotate_rows(xp + t0 * st, t1 - t0, H, st, sh, cp + t0 * half, sp + t0 * half, half);
    });
  }
}

// gate_up [..., 2 I] float32 contiguous -> act(gate) * up [..., I]: rows_fn(gate_up rows, T, I, out rows), silu,
// gelu (tanh form) or GPT-OSS's clamped SwiGLU.
template <class RowsFn>
at::Tensor gated(const at::Tensor& gate_up, const RowsFn& rows_fn) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.scalar_type() == at::kFloat && gate_up.is_contiguous() &&
              gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "gate_up: [..., 2 I] float32 CPU contiguous");
  const int64_t I = gate_up.size(-1) / 2, rows = I ? gate_up.numel() / (2 * I) : 0;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = at::empty(sizes, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_for(0, rows, row_grain(I), [&](int64_t r0, int64_t r1) {
    rows_fn(gp + r0 * 2 * I, r1 - r0, I, op + r0 * I);
  });
  return out;
}

// ladder::silu_and_mul and ladder::gelu_tanh_and_mul.
at::Tensor silu_and_mul(const at::Tensor& gate_up) { return gated(gate_up, silu_and_mul_rows); }
at::Tensor gelu_tanh_and_mul(const at::Tensor& gate_up) { return gated(gate_up, gelu_tanh_and_mul_rows); }

// ladder::sigmoid_gate: out [T, n] * sigmoid(gate [T, n]) (float32 contiguous), as the decoder step gates them.
at::Tensor sigmoid_gate(const at::Tensor& out, const at::Tensor& gate) {
  for (const auto* t : {&out, &gate})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2,
                "sigmoid_gate: out and gate [T, n] float32 CPU contiguous");
  TORCH_CHECK(out.sizes() == gate.sizes(), "sigmoid_gate: out and gate of one shape");
  auto result = out.clone();
  sigmoid_gate_rows(result.data_ptr<float>(), gate.data_ptr<float>(), out.size(0), out.size(1), out.size(1));
  return result;
}

// ladder::clamped_swiglu: GPT-OSS's act of gate_up [..., 2 I] float32 contiguous -> [..., I].
at::Tensor clamped_swiglu(const at::Tensor& gate_up, double alpha, double limit) {
  const float a = static_cast<float>(alpha), l = static_cast<float>(limit);
  return gated(gate_up, [a, l](const float* g, int64_t T, int64_t I, float* o) {
    clamped_swiglu_rows(g, T, I, a, l, o);
  });
}

}  // namespace
}  // namespace ladder

TORCH_LIBRARY_IMPL(ladder, CPU, m) {
  m.impl("rms_norm", &ladder::rms_norm);
  m.impl("fused_add_rms_norm", &ladder::fused_add_rms_norm);
  m.impl("rotary", &ladder::rotary);
  m.impl("silu_and_mul", &ladder::silu_and_mul);
  m.impl("gelu_tanh_and_mul", &ladder::gelu_tanh_and_mul);
  m.impl("clamped_swiglu", &ladder::clamped_swiglu);
  m.impl("sigmoid_gate", &ladder::sigmoid_gate);
}
