"""RMSNorm (with the residual add) and the rotary embedding as single C++ calls, for float32 models on a CPU.

At batch 1 a decode step of a small model is bound by the number of operations, not by their arithmetic:
the torch reference of RMSNorm is six ATen calls (float, pow, mean, add, rsqrt, two multiplies) and the
rotary embedding a dozen (slices, casts, four multiplies, two adds, a concatenation), each a few
microseconds of dispatch on a shared CPU, sixty norms and thirty rotations a step. Here each is one call
that reads its inputs once. Every row (token) is computed alone, in the same order whatever the batch, so
results do not depend on what else is in the step.

The C++ functions are called directly (pybind, the cheapest call) in eager mode only: under torch.compile
the references are traced and Inductor fuses their element-wise work into its own loops. Other dtypes,
non-CPU tensors, or a machine where the library cannot be built (or LADDER_CPU_KERNELS=0) use the torch
references too.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import LazyExtension, cpu_kernels_enabled
from kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref
from kernels.rotary import rotate_ref

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

// out[d] = w[d] * (x[d] * rsqrt(mean(x^2) + eps)) for one row of D floats.
static inline void rms_row(const float* __restrict x, const float* __restrict w, float eps, int64_t D,
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

static void check_rows(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat, "float32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.size(-1) == w.numel(), "x [..., D] contiguous, weight [D]");
}

// x [..., D] float32 -> rms_norm(x) * weight.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_rows(x, w);
  auto out = torch::empty_like(x);
  const int64_t D = x.size(-1), rows = D ? x.numel() / D : 0;
  const float* xp = x.data_ptr<float>(); const float* wp = w.data_ptr<float>(); float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(D, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_row(xp + r * D, wp, static_cast<float>(eps), D, op + r * D);
  });
  return out;
}

// (rms_norm(x + residual) * weight, x + residual).
std::vector<torch::Tensor> fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  check_rows(x, w);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == torch::kFloat && residual.is_contiguous() &&
              residual.device().is_cpu(), "residual: x's shape, float32, contiguous");
  auto sum = torch::empty_like(x);
  auto out = torch::empty_like(x);
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
static void rotate_(torch::Tensor& x, const float* cp, const float* sp, int64_t half) {
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

void rotary_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  for (auto* x : {&q, &k}) {
    TORCH_CHECK(x->device().is_cpu() && x->scalar_type() == torch::kFloat && x->dim() == 3 && x->stride(2) == 1,
                "q, k: [T, heads, head_dim] float32 CPU, head_dim contiguous");
  }
  const int64_t half = q.size(2) / 2;
  TORCH_CHECK(q.size(2) == 2 * half && k.size(2) == q.size(2) && k.size(0) == q.size(0), "q, k: same T and even head_dim");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == q.size(0) && cos.size(1) == half &&
              sin.sizes() == cos.sizes(), "cos, sin: [T, head_dim / 2] float32 contiguous");
  rotate_(q, cos.data_ptr<float>(), sin.data_ptr<float>(), half);
  rotate_(k, cos.data_ptr<float>(), sin.data_ptr<float>(), half);
}
"""

_extension = LazyExtension("ladder_cpu_fused_ops", SOURCE, ["rms_norm", "fused_add_rms_norm", "rotary_"],
                           "CPU fused norm and rotary kernels")


def load():
    """The compiled module, or None when it cannot be built here."""
    return _extension.load()


def _native(*tensors: torch.Tensor):
    """The C++ module when every tensor is float32 on the CPU and the kernels are on, in eager mode; else
    None. Under torch.compile the references are traced: Inductor fuses their element-wise ops itself."""
    if torch.compiler.is_compiling() or not cpu_kernels_enabled() or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return None
    return load()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D]; `kernels.rms_norm.rms_norm_ref` up to float rounding."""
    module = _native(x, weight)
    if module is None:
        return rms_norm_ref(x, weight, eps)
    return module.rms_norm(x.contiguous(), weight.contiguous(), eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    module = _native(x, residual, weight)
    if module is None:
        return fused_add_rms_norm_ref(x, residual, weight, eps)
    normed, summed = module.fused_add_rms_norm(x.contiguous(), residual.contiguous(), weight.contiguous(), eps)
    return normed, summed


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D] rotated in place by cos, sin [T, D/2] float32; returns (q, k)."""
    module = _native(q, k, cos, sin)
    if module is None or q.stride(-1) != 1 or k.stride(-1) != 1:
        return rotate_ref(q, cos, sin), rotate_ref(k, cos, sin)
    module.rotary_(q, k, cos.contiguous(), sin.contiguous())
    return q, k


if __name__ == "__main__":
    import sys

    sys.exit(_extension.build_and_report())
