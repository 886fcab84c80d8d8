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

#include "parallel.h"

namespace ladder {
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

// One value head of one sequence: S [Dk, Dv] advanced in place; out [Dv] = the gated, normed output.
void head_step(float* __restrict S, const float* __restrict q, const float* __restrict k, const float* __restrict v,
               const float* __restrict z, const float* __restrict norm_weight, float decay, float beta, float eps,
               int64_t Dk, int64_t Dv, float* __restrict read_k, float* __restrict read_q, float* __restrict out) {
  for (int64_t j = 0; j < Dv; ++j) read_k[j] = read_q[j] = 0.f;
  float kq = 0.f;
  for (int64_t i = 0; i < Dk; ++i) {
    const float ki = k[i], qi = q[i];
    const float* __restrict row = S + i * Dv;
    kq += ki * qi;
#pragma omp simd
    for (int64_t j = 0; j < Dv; ++j) {
      read_k[j] += row[j] * ki;
      read_q[j] += row[j] * qi;
    }
  }
  float* __restrict u = read_k;  // u overwrites S^T k, read once per j
#pragma omp simd
  for (int64_t j = 0; j < Dv; ++j) {
    u[j] = beta * (v[j] - decay * read_k[j]);
    out[j] = decay * read_q[j] + kq * u[j];
  }
  for (int64_t i = 0; i < Dk; ++i) {
    const float ki = k[i];
    float* __restrict row = S + i * Dv;
#pragma omp simd
    for (int64_t j = 0; j < Dv; ++j) row[j] = row[j] * decay + ki * u[j];
  }
  float ss = 0.f;
  for (int64_t j = 0; j < Dv; ++j) ss += out[j] * out[j];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(Dv) + eps);
  for (int64_t j = 0; j < Dv; ++j) out[j] = out[j] * r * norm_weight[j] * silu(z[j]);
}

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), name,
              ": float32, contiguous, on the CPU");
}

// projected [B, C + Hv Dv + 2 Hv], pool [S, (K - 1) C + Hv Dk Dv], slots [B] int64, conv_weight [C, K],
// A_log and dt_bias [Hv], norm_weight [Dv] -> [B, Hv Dv].
at::Tensor gated_delta_decode(const at::Tensor& projected, at::Tensor& pool, const at::Tensor& slots,
                              const at::Tensor& conv_weight, const at::Tensor& A_log, const at::Tensor& dt_bias,
                              const at::Tensor& norm_weight, int64_t key_heads, int64_t key_dim, int64_t value_dim,
                              bool tiled, double eps) {
  for (auto [t, name] : {std::pair{&projected, "projected"}, {&pool, "pool"}, {&conv_weight, "conv_weight"},
                         {&A_log, "A_log"}, {&dt_bias, "dt_bias"}, {&norm_weight, "norm_weight"}})
    check_float(*t, name);
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "slots: [B] int64");
  const int64_t B = projected.size(0), C = conv_weight.size(0), K = conv_weight.size(1);
  const int64_t Hk = key_heads, Dk = key_dim, Dv = value_dim, Hv = A_log.numel();
  TORCH_CHECK(projected.dim() == 2 && slots.size(0) == B && projected.size(1) == C + Hv * Dv + 2 * Hv &&
              C == 2 * Hk * Dk + Hv * Dv && Hk > 0 && Hv % Hk == 0 && dt_bias.numel() == Hv &&
              norm_weight.numel() == Dv && pool.dim() == 2 && pool.size(1) == (K - 1) * C + Hv * Dk * Dv,
              "gated_delta_decode: shapes do not agree");
  const int64_t width = projected.size(1), state_width = pool.size(1), num_slots = pool.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(0 <= slot[b] && slot[b] < num_slots, "slots: a slot outside the pool's ", num_slots, " rows");
  auto out = at::empty({B, Hv * Dv}, projected.options());
  std::vector<float> conv(B * C);  // each token's convolution output: queries, keys (normed), values
  const float* pp = projected.data_ptr<float>();
  const float* wp = conv_weight.data_ptr<float>();
  float* poolp = pool.data_ptr<float>();
  parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float* state = poolp + slot[b] * state_width;  // [K - 1, C]: the last K - 1 inputs, oldest first
      const float* x = pp + b * width;
      float* y = conv.data() + b * C;
      for (int64_t c = 0; c < C; ++c) {
        const float* w = wp + c * K;
        float acc = state[c] * w[0];  // taps summed oldest first, as the reference
        for (int64_t j = 1; j < K - 1; ++j) acc += state[j * C + c] * w[j];
        acc += x[c] * w[K - 1];
        y[c] = silu(acc);
        for (int64_t j = 0; j + 1 < K - 1; ++j) state[j * C + c] = state[(j + 1) * C + c];
        state[(K - 2) * C + c] = x[c];
      }
      for (int64_t h = 0; h < Hk; ++h) {
        l2_normalize(y + h * Dk, Dk, 1.f / std::sqrt(static_cast<float>(Dk)));
        l2_normalize(y + Hk * Dk + h * Dk, Dk, 1.f);
      }
    }
  });
  const float* ap = A_log.data_ptr<float>();
  const float* dp = dt_bias.data_ptr<float>();
  const float* np = norm_weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t repeat = Hv / Hk;
  parallel_for(0, B * Hv, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> scratch(2 * Dv);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / Hv, h = p % Hv, kh = tiled ? h % Hk : h / repeat;
      const float* y = conv.data() + b * C;
      const float* row = pp + b * width;
      const float* z = row + C + h * Dv;
      const float beta = 1.f / (1.f + std::exp(-row[C + Hv * Dv + h]));
      const float g = -std::exp(ap[h]) * softplus(row[C + Hv * Dv + Hv + h] + dp[h]);
      float* S = poolp + slot[b] * state_width + (K - 1) * C + h * Dk * Dv;
      head_step(S, y + kh * Dk, y + Hk * Dk + kh * Dk, y + 2 * Hk * Dk + h * Dv, z, np, std::exp(g), beta,
                static_cast<float>(eps), Dk, Dv, scratch.data(), scratch.data() + Dv, op + b * Hv * Dv + h * Dv);
    }
  });
  return out;
}

}  // namespace
}  // namespace ladder

TORCH_LIBRARY_IMPL(ladder, CPU, m) { m.impl("gated_delta_decode", &ladder::gated_delta_decode); }
