// A mixture-of-experts layer's W4A8 experts in one call (kernels/cpu_w4a8_experts.py): the routed (token,
// expert) pairs grouped by expert in pair order, each expert's rows through w4a8_rows (gate and up),
// silu_and_mul_rows and w4a8_rows (down), each pair's row scaled by its routing weight, and each token's k
// rows summed in slot order. The same functions and float operations in the same order as its reference,
// kernels/moe.py `grouped_experts` over the ops of those kernels, so the two are equal bit for bit.
#include <torch/library.h>

#include <vector>

#include "cpu_kernels.h"
#include "tile.h"

namespace ladder {
namespace {

// Expert e of a stack packed as cpu_w4a8_linear.pack packs one weight: codes [E, NBLK, KB, CB] uint8,
// scales [E, NBLK, KB, S, 16] float16.
W4A8Weight expert_weight(const at::Tensor& codes, const at::Tensor& scales, int64_t e, int64_t N, int64_t zero) {
  const int64_t NBLK = codes.size(1), KB = codes.size(2), CB = codes.size(3), S = scales.size(3);
  const auto* scale_bits = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  return W4A8Weight{codes.data_ptr<uint8_t>() + e * NBLK * KB * CB, scale_bits + e * NBLK * KB * S * BN, nullptr,
                    N, KB * 32, NBLK, static_cast<int>(S), CB == 256, static_cast<int32_t>(zero)};
}

void check_stack(const at::Tensor& codes, const at::Tensor& scales, const char* name) {
  TORCH_CHECK(codes.device().is_cpu() && codes.dim() == 4 && codes.scalar_type() == at::kByte &&
                  codes.is_contiguous() && (codes.size(3) == 256 || codes.size(3) == 512),
              name, " codes: [E, NBLK, KB, 256 or 512] uint8 contiguous CPU");
  TORCH_CHECK(scales.device().is_cpu() && scales.dim() == 5 && scales.scalar_type() == at::kHalf &&
                  scales.is_contiguous() && scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) &&
                  scales.size(2) == codes.size(2) && (scales.size(3) == 1 || scales.size(3) == 2) &&
                  scales.size(4) == BN,
              name, " scales: [E, NBLK, KB, 1 or 2, 16] float16 contiguous CPU, as its codes");
}

at::Tensor w4a8_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& experts,
                        const at::Tensor& w13_codes, const at::Tensor& w13_scales, int64_t w13_zero,
                        const at::Tensor& w2_codes, const at::Tensor& w2_scales, int64_t w2_zero,
                        int64_t expert_offset) {
  check_rows(x);
  check_stack(w13_codes, w13_scales, "w13");
  check_stack(w2_codes, w2_scales, "w2");
  const int64_t T = x.size(0), H = x.size(1), E = w13_codes.size(0), I = w2_codes.size(2) * 32;
  TORCH_CHECK(weights.dim() == 2 && weights.size(0) == T && weights.scalar_type() == at::kFloat &&
                  weights.is_contiguous(), "weights: [T, k] float32 contiguous");
  TORCH_CHECK(experts.sizes() == weights.sizes() && experts.scalar_type() == at::kLong && experts.is_contiguous(),
              "experts: [T, k] int64 contiguous, as weights");
  TORCH_CHECK(w2_codes.size(0) == E && w13_codes.size(2) * 32 == H && w2_codes.size(1) * BN >= H &&
                  w13_codes.size(1) * BN >= 2 * I,
              "w13 [E, 2I, H] and w2 [E, H, I] do not match x's H = ", H);
  const int64_t k = weights.size(1), P = T * k;
  const float* xp = x.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  const int64_t* ep = experts.data_ptr<int64_t>();

  // Pairs p = t * k + slot, grouped by held expert in pair order (the reference's stable sort).
  std::vector<std::vector<int64_t>> pairs(E);
  for (int64_t p = 0; p < P; ++p) {
    const int64_t e = ep[p] - expert_offset;
    if (e >= 0 && e < E) pairs[e].push_back(p);
  }
  auto pair_out = at::zeros({P, H}, x.options());  // pairs of experts held elsewhere stay 0
  float* po = pair_out.data_ptr<float>();
  std::vector<float> rows, gate_up, act, down;
  W4A8Scratch scratch;
  for (int64_t e = 0; e < E; ++e) {
    const auto& mine = pairs[e];
    const int64_t n = static_cast<int64_t>(mine.size());
    if (n == 0) continue;
    rows.resize(n * H);
    for (int64_t i = 0; i < n; ++i) std::copy(xp + (mine[i] / k) * H, xp + (mine[i] / k + 1) * H, rows.data() + i * H);
    gate_up.resize(n * 2 * I);
    w4a8_rows(rows.data(), n, expert_weight(w13_codes, w13_scales, e, 2 * I, w13_zero), gate_up.data(), scratch,
              false);
    act.resize(n * I);
    silu_and_mul_rows(gate_up.data(), n, I, act.data());
    down.resize(n * H);
    w4a8_rows(act.data(), n, expert_weight(w2_codes, w2_scales, e, H, w2_zero), down.data(), scratch, false);
    for (int64_t i = 0; i < n; ++i) {
      const float w = wp[mine[i]];
      float* dst = po + mine[i] * H;
      const float* src = down.data() + i * H;
      for (int64_t h = 0; h < H; ++h) dst[h] = src[h] * w;
    }
  }
  // Each token's k rows added in slot order, element by element.
  auto total = at::empty({T, H}, x.options());
  float* tp = total.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    float* dst = tp + t * H;
    std::copy(po + t * k * H, po + (t * k + 1) * H, dst);
    for (int64_t slot = 1; slot < k; ++slot) {
      const float* src = po + (t * k + slot) * H;
      for (int64_t h = 0; h < H; ++h) dst[h] += src[h];
    }
  }
  return total;
}

}  // namespace
}  // namespace ladder

TORCH_LIBRARY_IMPL(ladder, CPU, m) { m.impl("w4a8_experts", &ladder::w4a8_experts); }
