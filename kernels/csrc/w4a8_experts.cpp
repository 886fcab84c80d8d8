// A mixture-of-experts layer's W4A8 experts in one call (kernels/cpu_w4a8_experts.py): the routed (token,
// expert) pairs grouped by expert in pair order, each expert's rows through w4a8_rows (gate and up),
// silu_and_mul_rows (gelu_tanh_and_mul_rows for Gemma 4's experts, clamped_swiglu_rows and biases for GPT-OSS's)
// and w4a8_rows (down), each pair's row scaled
// by its routing weight, and each token's k rows summed in slot order. The same functions and float operations in the same order as its reference,
// kernels/moe.py `grouped_experts` over the ops of those kernels, so the two are equal bit for bit.
#include <torch/library.h>

#include <vector>

#include "cpu_kernels.h"
#include "tile.h"

namespace ladder {

void w4a8_experts_rows(const float* x, int64_t T, int64_t H, const float* weights, const int64_t* experts, int64_t k,
                       const W4A8Stack& w13, const W4A8Stack& w2, int64_t expert_offset, float* out,
                       W4A8Scratch& scratch, bool gelu, const float* b13, const float* b2, float swiglu_limit,
                       float swiglu_alpha) {
  const int64_t E = w13.E, I = w2.KB * 32, P = T * k;
  // Pairs p = t * k + slot, grouped by held expert in pair order (the reference's stable sort).
  std::vector<std::vector<int64_t>> pairs(E);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t e = experts[p] - expert_offset;
    if (e >= 0 && e < E) pairs[e].push_back(p);
  }
  std::vector<float> pair_out(P * H, 0.f);  // pairs of experts held elsewhere stay 0
  std::vector<float> rows, gate_up, act, down;
  for (int64_t e = 0; e < E; ++e) {
    const auto& mine = pairs[e];
    const int64_t n = static_cast<int64_t>(mine.size());
    if (n == 0) continue;
    rows.resize(n * H);
    for (int64_t i = 0; i < n; ++i) std::copy(x + (mine[i] / k) * H, x + (mine[i] / k + 1) * H, rows.data() + i * H);
    gate_up.resize(n * 2 * I);
    W4A8Weight first = w13.expert(e), second = w2.expert(e);
    first.bias = b13 ? b13 + e * 2 * I : nullptr;  // GPT-OSS's experts' biases, added by the kernel
    second.bias = b2 ? b2 + e * H : nullptr;
    w4a8_rows(rows.data(), n, first, gate_up.data(), scratch, false);
    act.resize(n * I);
    if (swiglu_limit > 0.f) {
      clamped_swiglu_rows(gate_up.data(), n, I, swiglu_alpha, swiglu_limit, act.data());
    } else {
      (gelu ? gelu_tanh_and_mul_rows : silu_and_mul_rows)(gate_up.data(), n, I, act.data());
    }
    down.resize(n * H);
    w4a8_rows(act.data(), n, second, down.data(), scratch, false);
    for (int64_t i = 0; i < n; ++i) {
      const float w = weights[mine[i]];
      float* dst = pair_out.data() + mine[i] * H;
      const float* src = down.data() + i * H;
      for (int64_t h = 0; h < H; ++h) dst[h] = src[h] * w;
    }
  }
  // Each token's k rows added in slot order, element by element.
  for (int64_t t = 0; t < T; ++t) {
    float* dst = out + t * H;
    const float* first = pair_out.data() + t * k * H;
    std::copy(first, first + H, dst);
    for (int64_t slot = 1; slot < k; ++slot) {
      const float* src = pair_out.data() + (t * k + slot) * H;
      for (int64_t h = 0; h < H; ++h) dst[h] += src[h];
    }
  }
}

// A stack's tensors (checked) as the kernel takes them; N the rows of each expert's weight.
W4A8Stack w4a8_stack(const at::Tensor& codes, const at::Tensor& scales, int64_t N, int64_t zero, const char* name) {
  TORCH_CHECK(codes.device().is_cpu() && codes.dim() == 4 && codes.scalar_type() == at::kByte &&
                  codes.is_contiguous() && w4a8_code_bits(codes.size(3)) != 0,
              name, " codes: [E, NBLK, KB, 256, 320 or 512] uint8 contiguous CPU");
  TORCH_CHECK(scales.device().is_cpu() && scales.dim() == 5 && scales.scalar_type() == at::kHalf &&
                  scales.is_contiguous() && scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) &&
                  scales.size(2) == codes.size(2) && (scales.size(3) == 1 || scales.size(3) == 2) &&
                  scales.size(4) == BN,
              name, " scales: [E, NBLK, KB, 1 or 2, 16] float16 contiguous CPU, as its codes");
  TORCH_CHECK(N > (codes.size(1) - 1) * BN && N <= codes.size(1) * BN, name, ": ", N, " rows do not match ",
              codes.size(1), " packed blocks");
  return W4A8Stack{codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                   codes.size(0), N, codes.size(1), codes.size(2), scales.size(3), w4a8_code_bits(codes.size(3)),
                   static_cast<int32_t>(zero)};
}

namespace {

at::Tensor w4a8_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& experts,
                        const at::Tensor& w13_codes, const at::Tensor& w13_scales, int64_t w13_zero,
                        const at::Tensor& w2_codes, const at::Tensor& w2_scales, int64_t w2_zero,
                        int64_t expert_offset, bool gelu, const std::optional<at::Tensor>& w13_bias,
                        const std::optional<at::Tensor>& w2_bias, double swiglu_limit, double swiglu_alpha) {
  check_rows(x);
  const int64_t T = x.size(0), H = x.size(1), I = w2_codes.dim() == 4 ? w2_codes.size(2) * 32 : 0;
  TORCH_CHECK(weights.dim() == 2 && weights.size(0) == T && weights.scalar_type() == at::kFloat &&
                  weights.is_contiguous(), "weights: [T, k] float32 contiguous");
  TORCH_CHECK(experts.sizes() == weights.sizes() && experts.scalar_type() == at::kLong && experts.is_contiguous(),
              "experts: [T, k] int64 contiguous, as weights");
  const W4A8Stack w13 = w4a8_stack(w13_codes, w13_scales, 2 * I, w13_zero, "w13");
  const W4A8Stack w2 = w4a8_stack(w2_codes, w2_scales, H, w2_zero, "w2");
  TORCH_CHECK(w2.E == w13.E && w13.KB * 32 == H, "w13 [E, 2I, H] and w2 [E, H, I] do not match x's H = ", H);
  // Biases [E, 2I] and [E, H] float32 contiguous, or none.
  auto bias_of = [](const std::optional<at::Tensor>& b, int64_t E, int64_t N, const char* name) -> const float* {
    if (!b.has_value()) return nullptr;
    TORCH_CHECK(b->device().is_cpu() && b->scalar_type() == at::kFloat && b->is_contiguous() && b->dim() == 2 &&
                    b->size(0) == E && b->size(1) == N, name, ": [E, N] float32 contiguous CPU, one row an expert");
    return b->data_ptr<float>();
  };
  const float* b13 = bias_of(w13_bias, w13.E, 2 * I, "w13_bias");
  const float* b2 = bias_of(w2_bias, w2.E, H, "w2_bias");
  auto out = at::empty({T, H}, x.options());
  W4A8Scratch scratch;
  w4a8_experts_rows(x.data_ptr<float>(), T, H, weights.data_ptr<float>(), experts.data_ptr<int64_t>(),
                    weights.size(1), w13, w2, expert_offset, out.data_ptr<float>(), scratch, gelu, b13, b2,
                    static_cast<float>(swiglu_limit), static_cast<float>(swiglu_alpha));
  return out;
}

}  // namespace
}  // namespace ladder

TORCH_LIBRARY_IMPL(ladder, CPU, m) { m.impl("w4a8_experts", &ladder::w4a8_experts); }
