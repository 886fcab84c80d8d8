// ladder::gated_delta_decode: one new token of each of B sequences through a linear-attention layer (Qwen3.5's
// Gated DeltaNet), from its input projection to its output projection's input, each sequence's state advanced in
// place in its row of the layer's pool. kernels/gated_delta.py has the reference and the rule's algebra.
//
// Per sequence: the causal convolution over the state's last K - 1 inputs and the new one (SiLU), the state's
// inputs shifted; queries and keys L2-normed per key head (queries scaled by Dk^-1/2). Then per (sequence, value
// head), in parallel: one pass over the head's state S [Dk, Dv] reads S^T k and S^T q together, a second updates
// S = exp(g) S + k u^T, where u = beta (v - exp(g) S^T k), and the output exp(g) S^T q + (k . q) u is RMS-normed,
// scaled and gated by SiLU(z). Each output is computed alone, in one order, whatever the batch.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_kernels.h"
#include "parallel.h"
#include "vec_exp.h"

namespace ladder {
namespace gated_delta {  // its own names: the build joins several sources into one unit
namespace {

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

// torch.nn.functional.softplus (beta 1, threshold 20).
inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

void l2_normalize(float* __restrict x, int64_t n, float scale) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = scale / std::sqrt(ss + 1e-6f);
  for (int64_t i = 0; i < n; ++i) x[i] *= r;
}

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kLanes = 16, kTile = 8;  // a tile of 128 columns: 8 + 8 accumulators of 32 registers
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vset(float x) { return _mm512_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vzero() { return _mm512_setzero_ps(); }
#define LADDER_GDN_VECTOR 1
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
constexpr int64_t kLanes = 8, kTile = 4;  // a tile of 32 columns: 4 + 4 accumulators of 16 registers
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vset(float x) { return _mm256_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vzero() { return _mm256_setzero_ps(); }
#define LADDER_GDN_VECTOR 1
#endif

// One value head of one sequence: S [Dk, Dv] advanced in place; out [Dv] = its output exp(g) S^T q + (k . q) u,
// before the norm. Columns a tile at a time: the tile's S^T k and S^T q accumulate in registers over the Dk rows
// (one read of them), then the same rows (now in cache) are updated with the tile's u.
void head_step(float* __restrict S, const float* __restrict q, const float* __restrict k, const float* __restrict v,
               float decay, float beta, int64_t Dk, int64_t Dv, float* __restrict out) {
  float kq = 0.f;
  for (int64_t i = 0; i < Dk; ++i) kq += k[i] * q[i];
  int64_t c0 = 0;
#ifdef LADDER_GDN_VECTOR
  const Vec vdecay = vset(decay), vbeta = vset(beta), vkq = vset(kq);
  for (; c0 + kTile * kLanes <= Dv; c0 += kTile * kLanes) {
    Vec ak[kTile], aq[kTile];
    for (int t = 0; t < kTile; ++t) ak[t] = aq[t] = vzero();
    for (int64_t i = 0; i < Dk; ++i) {
      const float* row = S + i * Dv + c0;
      const Vec ki = vset(k[i]), qi = vset(q[i]);
      for (int t = 0; t < kTile; ++t) {
        const Vec s = vload(row + t * kLanes);
        ak[t] = vfma(s, ki, ak[t]);
        aq[t] = vfma(s, qi, aq[t]);
      }
    }
    Vec u[kTile];
    for (int t = 0; t < kTile; ++t) {
      u[t] = vmul(vbeta, vsub(vload(v + c0 + t * kLanes), vmul(vdecay, ak[t])));
      vstore(out + c0 + t * kLanes, vfma(vkq, u[t], vmul(vdecay, aq[t])));
    }
    for (int64_t i = 0; i < Dk; ++i) {
      float* row = S + i * Dv + c0;
      const Vec ki = vset(k[i]);
      for (int t = 0; t < kTile; ++t) vstore(row + t * kLanes, vfma(ki, u[t], vmul(vload(row + t * kLanes), vdecay)));
    }
  }
#endif
  if (c0 == Dv) return;
  // The columns past the last whole tile (all of them without a vector unit), one at a time.
  for (int64_t j = c0; j < Dv; ++j) {
    float read_k = 0.f, read_q = 0.f;
    for (int64_t i = 0; i < Dk; ++i) {
      read_k += S[i * Dv + j] * k[i];
      read_q += S[i * Dv + j] * q[i];
    }
    const float u = beta * (v[j] - decay * read_k);
    out[j] = decay * read_q + kq * u;
    for (int64_t i = 0; i < Dk; ++i) S[i * Dv + j] = S[i * Dv + j] * decay + k[i] * u;
  }
}

// out [Dv] RMS-normed, times the weight and SiLU(z), in place.
void gated_norm(float* __restrict out, const float* __restrict z, const float* __restrict weight, float eps,
                int64_t Dv) {
  float ss = 0.f;
  for (int64_t j = 0; j < Dv; ++j) ss += out[j] * out[j];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(Dv) + eps);
  for (int64_t j = 0; j < Dv; ++j) out[j] = out[j] * r * weight[j] * silu(z[j]);
}

// The causal convolution of one token over C channels (SiLU after), the state's inputs shifted in place. taps
// [K, C]: tap j of every channel contiguous, so channels run in vector lanes; state [K - 1, C]; x, y [C].
void conv_step(float* __restrict state, const float* __restrict x, const float* __restrict taps, int64_t K, int64_t C,
               float* __restrict y) {
  int64_t c = 0;
#ifdef __AVX512F__
  for (; c + 16 <= C; c += 16) {  // taps summed oldest first, as the reference
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(state + c), _mm512_loadu_ps(taps + c));
    for (int64_t j = 1; j < K - 1; ++j)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(state + j * C + c), _mm512_loadu_ps(taps + j * C + c), acc);
    const __m512 xc = _mm512_loadu_ps(x + c);
    acc = _mm512_fmadd_ps(xc, _mm512_loadu_ps(taps + (K - 1) * C + c), acc);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), acc));
    _mm512_storeu_ps(y + c, _mm512_div_ps(acc, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
    for (int64_t j = 0; j + 1 < K - 1; ++j) _mm512_storeu_ps(state + j * C + c, _mm512_loadu_ps(state + (j + 1) * C + c));
    _mm512_storeu_ps(state + (K - 2) * C + c, xc);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  for (; c + 8 <= C; c += 8) {
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(state + c), _mm256_loadu_ps(taps + c));
    for (int64_t j = 1; j < K - 1; ++j)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(state + j * C + c), _mm256_loadu_ps(taps + j * C + c), acc);
    const __m256 xc = _mm256_loadu_ps(x + c);
    acc = _mm256_fmadd_ps(xc, _mm256_loadu_ps(taps + (K - 1) * C + c), acc);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), acc));
    _mm256_storeu_ps(y + c, _mm256_div_ps(acc, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
    for (int64_t j = 0; j + 1 < K - 1; ++j) _mm256_storeu_ps(state + j * C + c, _mm256_loadu_ps(state + (j + 1) * C + c));
    _mm256_storeu_ps(state + (K - 2) * C + c, xc);
  }
#endif
  for (; c < C; ++c) {
    float acc = state[c] * taps[c];
    for (int64_t j = 1; j < K - 1; ++j) acc += state[j * C + c] * taps[j * C + c];
    acc += x[c] * taps[(K - 1) * C + c];
    y[c] = silu(acc);
    for (int64_t j = 0; j + 1 < K - 1; ++j) state[j * C + c] = state[(j + 1) * C + c];
    state[(K - 2) * C + c] = x[c];
  }
}

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), name,
              ": float32, contiguous, on the CPU");
}

// projected [B, C + Hv Dv + 2 Hv], pool [S, (K - 1) C + Hv Dk Dv], slots [B] int64, conv_taps [K, C],
// A_log and dt_bias [Hv], norm_weight [Dv] -> [B, Hv Dv] (`gated_delta_rows`).
at::Tensor gated_delta_decode(const at::Tensor& projected, at::Tensor& pool, const at::Tensor& slots,
                              const at::Tensor& conv_taps, const at::Tensor& A_log, const at::Tensor& dt_bias,
                              const at::Tensor& norm_weight, int64_t key_heads, int64_t key_dim, int64_t value_dim,
                              bool tiled, double eps) {
  for (auto [t, name] : {std::pair{&projected, "projected"}, {&pool, "pool"}, {&conv_taps, "conv_taps"},
                         {&A_log, "A_log"}, {&dt_bias, "dt_bias"}, {&norm_weight, "norm_weight"}})
    check_float(*t, name);
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "slots: [B] int64");
  const int64_t B = projected.size(0), K = conv_taps.size(0), C = conv_taps.size(1);
  const int64_t Hk = key_heads, Dk = key_dim, Dv = value_dim, Hv = A_log.numel();
  TORCH_CHECK(conv_taps.dim() == 2 && K >= 2 && projected.dim() == 2 && slots.size(0) == B &&
              projected.size(1) == C + Hv * Dv + 2 * Hv && C == 2 * Hk * Dk + Hv * Dv && Hk > 0 && Hv % Hk == 0 &&
              dt_bias.numel() == Hv && norm_weight.numel() == Dv && pool.dim() == 2 &&
              pool.size(1) == (K - 1) * C + Hv * Dk * Dv, "gated_delta_decode: shapes do not agree");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(0 <= slot[b] && slot[b] < pool.size(0), "slots: a slot outside the pool's ", pool.size(0), " rows");
  auto out = at::empty({B, Hv * Dv}, projected.options());
  gated_delta_rows(projected.data_ptr<float>(), B, projected.size(1), pool.data_ptr<float>(), pool.size(1), slot,
                   conv_taps.data_ptr<float>(), K, C, A_log.data_ptr<float>(), dt_bias.data_ptr<float>(),
                   norm_weight.data_ptr<float>(), Hk, Dk, Dv, Hv, tiled, static_cast<float>(eps),
                   out.data_ptr<float>());
  return out;
}

// ladder::causal_conv: a prompt's run through the convolution, window [K - 1 + L, C] (the state's last K - 1
// inputs, then the run's) and taps [K, C] -> SiLU of the convolution [L, C], rows in parallel, channels in lanes.
at::Tensor causal_conv(const at::Tensor& window, const at::Tensor& taps) {
  check_float(window, "window");
  check_float(taps, "taps");
  const int64_t K = taps.size(0), C = taps.size(1), L = window.size(0) - K + 1;
  TORCH_CHECK(window.dim() == 2 && taps.dim() == 2 && window.size(1) == C && K >= 1 && L >= 0,
              "causal_conv: window [K - 1 + L, C] and taps [K, C]");
  auto out = at::empty({L, C}, window.options());
  const float* wp = window.data_ptr<float>();
  const float* tp = taps.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_for(0, L, std::max<int64_t>(1, 32768 / std::max<int64_t>(C * K, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* rows = wp + t * C;  // row j of the window is input t + j
      float* y = op + t * C;
      int64_t c = 0;
#ifdef __AVX512F__
      for (; c + 16 <= C; c += 16) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(rows + c), _mm512_loadu_ps(tp + c));
        for (int64_t j = 1; j < K; ++j)
          acc = _mm512_fmadd_ps(_mm512_loadu_ps(rows + j * C + c), _mm512_loadu_ps(tp + j * C + c), acc);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), acc));
        _mm512_storeu_ps(y + c, _mm512_div_ps(acc, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
      }
#elif defined(__AVX2__) && defined(__FMA__)
      for (; c + 8 <= C; c += 8) {
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(rows + c), _mm256_loadu_ps(tp + c));
        for (int64_t j = 1; j < K; ++j)
          acc = _mm256_fmadd_ps(_mm256_loadu_ps(rows + j * C + c), _mm256_loadu_ps(tp + j * C + c), acc);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), acc));
        _mm256_storeu_ps(y + c, _mm256_div_ps(acc, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
      }
#endif
      for (; c < C; ++c) {
        float acc = rows[c] * tp[c];
        for (int64_t j = 1; j < K; ++j) acc += rows[j * C + c] * tp[j * C + c];
        y[c] = silu(acc);
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace gated_delta

void gated_delta_rows(const float* projected, int64_t B, int64_t width, float* pool, int64_t state_width,
                      const int64_t* slots, const float* taps, int64_t K, int64_t C, const float* a_log,
                      const float* dt_bias, const float* norm, int64_t Hk, int64_t Dk, int64_t Dv, int64_t Hv,
                      bool tiled, float eps, float* out) {
  using namespace gated_delta;
  std::vector<float> conv(B * C);  // each token's convolution output: queries, keys (normed), values
  parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float* y = conv.data() + b * C;
      conv_step(pool + slots[b] * state_width, projected + b * width, taps, K, C, y);  // the state's first rows
      for (int64_t h = 0; h < Hk; ++h) {
        l2_normalize(y + h * Dk, Dk, 1.f / std::sqrt(static_cast<float>(Dk)));
        l2_normalize(y + Hk * Dk + h * Dk, Dk, 1.f);
      }
    }
  });
  const int64_t repeat = Hv / Hk;
  parallel_for(0, B * Hv, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / Hv, h = p % Hv, kh = tiled ? h % Hk : h / repeat;
      const float* y = conv.data() + b * C;
      const float* row = projected + b * width;
      const float beta = 1.f / (1.f + std::exp(-row[C + Hv * Dv + h]));
      const float g = -std::exp(a_log[h]) * softplus(row[C + Hv * Dv + Hv + h] + dt_bias[h]);
      float* S = pool + slots[b] * state_width + (K - 1) * C + h * Dk * Dv;
      float* o = out + b * Hv * Dv + h * Dv;
      head_step(S, y + kh * Dk, y + Hk * Dk + kh * Dk, y + 2 * Hk * Dk + h * Dv, std::exp(g), beta, Dk, Dv, o);
      gated_norm(o, row + C + h * Dv, norm, eps, Dv);
    }
  });
}

}  // namespace ladder

TORCH_LIBRARY_IMPL(ladder, CPU, m) {
  m.impl("gated_delta_decode", &ladder::gated_delta::gated_delta_decode);
  m.impl("causal_conv", &ladder::gated_delta::causal_conv);
}
#undef LADDER_GDN_VECTOR
