"""W8A8 linear for the CPU: int8 weights times int8 activations quantized per row on the fly, int32 sums.

y [M, N] = (int32(q [M, K] @ w [N, K].T) * x_scale [M, 1]) * w_scale [N] (+ bias), where each row of x is
quantized symmetrically: x_scale = max(max|x_row|, 1e-12) / 127, q = round(x / x_scale) (half to even).

The integer sums are exact, so the C++ kernel returns the very bits of the torch reference
(`w8a8_matmul_ref`: `torch._int_mm`) whatever the blocking, thread count or batch: batch invariance
comes for free. It uses AVX-512 VNNI (`vpdpbusd`: 64 unsigned-by-signed byte products summed into 16
int32 lanes per instruction, four times the multiply-adds of a float32 FMA), which wants unsigned
activations: the kernel stores q + 128 and subtracts 128 * sum_k w[n, k] afterwards (`wsum`, computed once
at packing). One instruction per 64 weight bytes keeps batch-1 decode at the memory bound, where the
weight-only kernel spends three instructions per 16 weights widening them to float32.

Weights are packed once (`pack`) into blocks of 16 output channels by groups of 4 input channels,
[ceil(N / 16), ceil(K / 4), 16, 4] int8, zero-padded: one 64-byte load feeds one `vpdpbusd` for 16
channels. Threads split the blocks of output channels; a scalar loop over the same layout is compiled
where AVX-512 VNNI is missing. Built on first use like every CPU kernel (kernels/cpu_extension.py);
without it (or with LADDER_CPU_KERNELS=0) `w8a8_linear` runs the torch reference.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import LazyExtension, cpu_kernels_enabled

BLOCK_N = 16  # output channels per packed block
GROUP_K = 4  # input channels summed by one vpdpbusd lane

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
// Bit-equal to the torch reference: no multiply-add contraction of the epilogue's (y * s) + bias.
#pragma GCC optimize("fp-contract=off")
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define LADDER_VNNI 1
#include <immintrin.h>
#endif

constexpr int BN = 16;  // output channels per block
constexpr int GK = 4;   // input channels per vpdpbusd lane
constexpr int MAX_MR = 8;

// A row's scale from its max |x|: the reference's clamp, then / 127.
static inline float row_scale(float amax) { return std::max(amax, 1e-12f) / 127.f; }

// Row m of x [M, K] -> q + 128 as uint8 into xq [M, KP] (KP = K rounded up to GK, padded with 128, i.e.
// q = 0) and its scale. The arithmetic is the reference's: amax, clamp, / 127, x / scale, round to even.
// `given_amax`: the row's max |x| taken over more columns than these K (a row-parallel rank's part).
static void quantize_row(const float* x, int64_t K, int64_t KP, uint8_t* xq, float* x_scale,
                         const float* given_amax) {
  float amax = 0.f;
  if (given_amax) {
    amax = *given_amax;
  } else {
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  }
  const float s = row_scale(amax);
  *x_scale = s;
  int64_t k = 0;
#ifdef LADDER_VNNI
  const __m512 vs = _mm512_set1_ps(s);
  const __m512i bias = _mm512_set1_epi32(128);
  for (; k + 16 <= K; k += 16) {
    __m512 v = _mm512_div_ps(_mm512_loadu_ps(x + k), vs);
    __m512i q = _mm512_add_epi32(_mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), bias);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + k), _mm512_cvtepi32_epi8(q));
  }
#endif
  for (; k < K; ++k) xq[k] = static_cast<uint8_t>(static_cast<int32_t>(std::nearbyint(x[k] / s)) + 128);
  for (; k < KP; ++k) xq[k] = 128;
}

#ifdef LADDER_VNNI
// MR rows times NB consecutive blocks of 16 output channels, over all KG groups of 4 input channels.
// RAW: `out` is int32 and takes the exact integer sums, sum_k q w, without the float epilogue.
template <int MR, int NB, bool RAW>
static void tile(const uint8_t* __restrict xq, int64_t ldq, const int8_t* __restrict w, int64_t KG,
                 const int32_t* __restrict wsum, const float* __restrict xs, const float* __restrict scale,
                 const float* __restrict bias, void* __restrict out_, int64_t ldo, int64_t n0, int64_t N) {
  __m512i acc[MR][NB];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_si512();
  const int64_t bstride = KG * BN * GK;
  for (int64_t g = 0; g < KG; ++g) {
    __m512i wv[NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(w + j * bstride + g * BN * GK);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      int32_t four;
      std::memcpy(&four, xq + i * ldq + g * GK, sizeof(four));
      const __m512i xv = _mm512_set1_epi32(four);
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], xv, wv[j]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NB; ++j) {
    const int64_t col = n0 + j * BN;
    if (col >= N) break;
    const __mmask16 mask = N - col >= BN ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - col)) - 1u);
    const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(wsum + col), 7);  // 128 * sum_k w
    if constexpr (RAW) {
      int32_t* out = static_cast<int32_t*>(out_);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) _mm512_mask_storeu_epi32(out + i * ldo + col, mask, _mm512_sub_epi32(acc[i][j], offset));
      continue;
    }
    float* out = static_cast<float*>(out_);
    const __m512 s = _mm512_maskz_loadu_ps(mask, scale + col);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      // ((float)sum * x_scale) * w_scale (+ bias): the reference's order, no fused multiply-add.
      __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][j], offset)),
                                             _mm512_set1_ps(xs[i])), s);
      if (bias) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask, bias + col));
      _mm512_mask_storeu_ps(out + i * ldo + col, mask, y);
    }
  }
}
#else
template <int MR, int NB, bool RAW>
static void tile(const uint8_t* __restrict xq, int64_t ldq, const int8_t* __restrict w, int64_t KG,
                 const int32_t* __restrict wsum, const float* __restrict xs, const float* __restrict scale,
                 const float* __restrict bias, void* __restrict out_, int64_t ldo, int64_t n0, int64_t N) {
  const int64_t bstride = KG * BN * GK;
  for (int j = 0; j < NB; ++j)
    for (int c = 0; c < BN; ++c) {
      const int64_t col = n0 + j * BN + c;
      if (col >= N) return;
      for (int i = 0; i < MR; ++i) {
        int32_t sum = 0;
        for (int64_t g = 0; g < KG; ++g)
          for (int t = 0; t < GK; ++t)
            sum += static_cast<int32_t>(xq[i * ldq + g * GK + t]) * w[j * bstride + (g * BN + c) * GK + t];
        if constexpr (RAW) {
          static_cast<int32_t*>(out_)[i * ldo + col] = sum - 128 * wsum[col];
          continue;
        }
        float y = (static_cast<float>(sum - 128 * wsum[col]) * xs[i]) * scale[col];
        static_cast<float*>(out_)[i * ldo + col] = bias ? y + bias[col] : y;
      }
    }
}
#endif

// The widest group of blocks whose accumulators (MR * NB) and weights (NB) fit the 32 vector registers.
static inline int max_nb(int mr) {
  static const int table[MAX_MR + 1] = {0, 8, 6, 4, 4, 4, 3, 3, 3};
  return table[mr];
}

using TileFn = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, const int32_t*, const float*,
                        const float*, const float*, void*, int64_t, int64_t, int64_t);

template <int MR, bool RAW>
static TileFn pick_nb(int nb) {
  switch (nb) {
    case 1: return tile<MR, 1, RAW>;
    case 2: return tile<MR, 2, RAW>;
    case 3: return tile<MR, 3, RAW>;
    case 4: if constexpr (MR <= 5) return tile<MR, 4, RAW>; break;
    case 5: if constexpr (MR <= 2) return tile<MR, 5, RAW>; break;
    case 6: if constexpr (MR <= 2) return tile<MR, 6, RAW>; break;
    case 7: if constexpr (MR <= 1) return tile<MR, 7, RAW>; break;
    case 8: if constexpr (MR <= 1) return tile<MR, 8, RAW>; break;
  }
  TORCH_CHECK(false, "no ", MR, "x", nb, " tile");
}

template <bool RAW>
static TileFn pick(int mr, int nb) {
  switch (mr) {
    case 1: return pick_nb<1, RAW>(nb);
    case 2: return pick_nb<2, RAW>(nb);
    case 3: return pick_nb<3, RAW>(nb);
    case 4: return pick_nb<4, RAW>(nb);
    case 5: return pick_nb<5, RAW>(nb);
    case 6: return pick_nb<6, RAW>(nb);
    case 7: return pick_nb<7, RAW>(nb);
    case 8: return pick_nb<8, RAW>(nb);
  }
  TORCH_CHECK(false, "no ", mr, "-row tile");
}

// x [M, K] float32 contiguous CPU; packed [NBLK, KG, 16, 4] int8; wsum [NBLK * 16] int32; scale [N]
// float32; bias [N] float32 or none. Returns [M, N] float32, or with `raw` the int32 sums sum_k q w (the
// scales and bias not applied; a row-parallel layer sums them over its ranks exactly first). `row_max`
// [M] float32, if given, is each row's max |x| to quantize with instead of the row's own.
static torch::Tensor run(torch::Tensor x, torch::Tensor packed, torch::Tensor wsum, torch::Tensor scale,
                         c10::optional<torch::Tensor> bias, int64_t N, bool raw,
                         c10::optional<torch::Tensor> row_max = c10::nullopt) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && wsum.device().is_cpu() &&
              scale.device().is_cpu(), "w8a8_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: [M, K] float32");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kChar && packed.is_contiguous() &&
              packed.size(2) == BN && packed.size(3) == GK, "packed: [NBLK, KG, 16, 4] int8");
  const int64_t M = x.size(0), K = x.size(1), NBLK = packed.size(0), KG = packed.size(1);
  TORCH_CHECK(KG == (K + GK - 1) / GK, "packed holds ", KG * GK, " input channels, x has ", K);
  TORCH_CHECK(N > (NBLK - 1) * BN && N <= NBLK * BN, "n ", N, " does not match ", NBLK, " packed blocks");
  TORCH_CHECK(wsum.scalar_type() == torch::kInt && wsum.is_contiguous() && wsum.numel() == NBLK * BN,
              "wsum: [NBLK * 16] int32");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.is_contiguous() && scale.numel() == N, "scale: [N] float32");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == torch::kFloat && bias->is_contiguous() &&
                bias->numel() == N, "bias: [N] float32");
    bp = bias->data_ptr<float>();
  }
  const float* given = nullptr;
  if (row_max.has_value() && row_max->defined()) {
    TORCH_CHECK(row_max->device().is_cpu() && row_max->scalar_type() == torch::kFloat && row_max->is_contiguous() &&
                row_max->numel() == M, "row_max: [M] float32");
    given = row_max->data_ptr<float>();
  }
  auto out = torch::empty({M, N}, x.options().dtype(raw ? torch::kInt : torch::kFloat));
  if (M == 0 || N == 0) return out;
  const int64_t KP = KG * GK;
  std::vector<uint8_t> xq(M * KP);
  std::vector<float> xs(M);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_row(xp + m * K, K, KP, xq.data() + m * KP, xs.data() + m, given ? given + m : nullptr);
  });
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int32_t* sump = wsum.data_ptr<int32_t>();
  const float* sp = scale.data_ptr<float>();
  uint8_t* op = static_cast<uint8_t*>(out.data_ptr());  // 4-byte elements, float32 or int32
  const int group = max_nb(static_cast<int>(std::min<int64_t>(M, MAX_MR)));
  // Each thread gets at least ~256K multiply-adds (about a microsecond): tiny problems stay on one thread.
  const int64_t per_block = std::max<int64_t>(1, M * KP * BN);
  const int64_t grain = std::max<int64_t>(1, ((int64_t)262144 + per_block - 1) / per_block);
  at::parallel_for(0, NBLK, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b += group) {
      const int nb = static_cast<int>(std::min<int64_t>(group, b1 - b));
      const int8_t* wb = wp + b * KP * BN;
      for (int64_t m = 0; m < M; m += MAX_MR) {
        const int mr = static_cast<int>(std::min<int64_t>(MAX_MR, M - m));
        // max_nb(mr) >= nb for every mr <= min(M, MAX_MR), so one call covers all nb blocks.
        const TileFn fn = raw ? pick<true>(mr, nb) : pick<false>(mr, nb);
        fn(xq.data() + m * KP, KP, wb, KG, sump, xs.data() + m, sp, bp, op + 4 * m * N, N, b * BN, N);
      }
    }
  });
  return out;
}

torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor wsum, torch::Tensor scale,
                          c10::optional<torch::Tensor> bias, int64_t N) {
  return run(x, packed, wsum, scale, bias, N, false);
}

// x [M, K] -> int32 [M, N], sum_k q[m, k] w[n, k] with q x's rows quantized as `w8a8_linear` does (with
// the scale of `row_max`'s maxima when given).
torch::Tensor w8a8_linear_int32(torch::Tensor x, torch::Tensor packed, torch::Tensor wsum, int64_t N,
                                c10::optional<torch::Tensor> row_max) {
  auto ones = torch::ones({N}, x.options());  // unused by the raw tiles; keeps one argument check
  return run(x, packed, wsum, ones, c10::nullopt, N, true, row_max);
}

// The raw tiles' float epilogue on summed int32 sums [M, N]: ((float)sum * row_scale(row_max[m])) * scale[n]
// (+ bias[n]), the fused kernel's arithmetic in its order, so a row-parallel layer's result is its bits.
torch::Tensor w8a8_epilogue(torch::Tensor sums, torch::Tensor row_max, torch::Tensor scale,
                            c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(sums.device().is_cpu() && sums.dim() == 2 && sums.scalar_type() == torch::kInt && sums.is_contiguous(),
              "sums: [M, N] int32");
  const int64_t M = sums.size(0), N = sums.size(1);
  TORCH_CHECK(row_max.scalar_type() == torch::kFloat && row_max.is_contiguous() && row_max.numel() == M,
              "row_max: [M] float32");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.is_contiguous() && scale.numel() == N, "scale: [N] float32");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == N, "bias: [N] float32");
    bp = bias->data_ptr<float>();
  }
  auto out = torch::empty({M, N}, sums.options().dtype(torch::kFloat));
  const int32_t* sp = sums.data_ptr<int32_t>();
  const float* mp = row_max.data_ptr<float>();
  const float* wp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float xs = row_scale(mp[m]);
    for (int64_t n = 0; n < N; ++n) {
      const float y = (static_cast<float>(sp[m * N + n]) * xs) * wp[n];
      op[m * N + n] = bp ? y + bp[n] : y;
    }
  }
  return out;
}

// ladder::w8a8_linear for CPU tensors, straight from the dispatcher: x [..., K] float32 or bfloat16 ->
// [..., n] float32. LADDER_CPU_KERNELS=0 is handled in Python (the op's own body is the reference).
static torch::Tensor w8a8_linear_op(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& wsum,
                                    const torch::Tensor& scale, const c10::optional<torch::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.dim() >= 1, "x must have a last dimension");
  const int64_t K = x.size(-1);
  auto x2 = x.reshape({-1, K}).to(torch::kFloat).contiguous();
  c10::optional<torch::Tensor> b;
  if (bias.has_value() && bias->defined()) b = bias->to(torch::kFloat).contiguous();
  auto out = w8a8_linear(x2, packed.contiguous(), wsum.contiguous(), scale.to(torch::kFloat).contiguous(), b, n);
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  return out.view(sizes);
}

TORCH_LIBRARY_IMPL(ladder, CPU, m) { m.impl("w8a8_linear", &w8a8_linear_op); }
"""

_extension = LazyExtension("ladder_cpu_w8a8_linear", SOURCE, ["w8a8_linear", "w8a8_linear_int32", "w8a8_epilogue"],
                           "CPU W8A8 linear kernel")


def load():
    """The compiled module, or None when it cannot be built here."""
    return _extension.load()


def w8a8_matmul_ref(rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The reference: rows [M, K] float32 quantized per row to int8, times weight int8 [N, K] with scale [N],
    int32 accumulation -> [M, N] float32."""
    q, x_scale = quantize_rows_ref(rows)  # |rows / x_scale| <= 127 by construction
    # torch._int_mm returns garbage for a transposed [1, N] operand (K = 1, torch 2.13 on a CPU).
    acc = torch._int_mm(q, weight.t()) if weight.shape[1] > 1 else q.int() @ weight.int().t()
    return acc.float() * x_scale * scale


def row_scale(row_maximum: torch.Tensor) -> torch.Tensor:
    """A row's activation scale from its max |x|, op for op as the C++ kernel computes it."""
    return row_maximum.clamp(min=1e-12) / 127


def quantize_rows_ref(rows: torch.Tensor, row_max: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [M, K] float32 -> (q int8 [M, K], x_scale [M, 1] float32), as every W8A8 path quantizes: with
    each row's own max |x|, or with `row_max` [M, 1] (a row-parallel rank's columns, the whole row's)."""
    x_scale = row_scale(row_maximum(rows) if row_max is None else row_max)
    return torch.round(rows / x_scale).to(torch.int8), x_scale


def row_maximum(rows: torch.Tensor) -> torch.Tensor:
    """rows [M, K] -> max |x| of each row, [M, 1] (exact: a maximum does not round). abs + amax: the
    infinity norm computes the same value ten times slower on a CPU (104 vs 9 us for [32, 768])."""
    return rows.abs().amax(dim=-1, keepdim=True)


def w8a8_int32(x: torch.Tensor, packed: torch.Tensor, wsum: torch.Tensor, n: int,
               row_max: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 -> int32 [M, N]: the exact integer sums sum_k q[m, k] w[n, k] before any scale, so
    that `w8a8_epilogue(sums, max |x| per row, scale, bias)` is `w8a8_linear` bit for bit. A row-parallel
    layer adds its ranks' sums exactly before that epilogue, each rank quantizing its columns with the
    whole row's maximum, `row_max` [M, 1] (by default each row's own)."""
    module = load() if cpu_kernels_enabled() and x.device.type == "cpu" else None
    if module is not None:
        return module.w8a8_linear_int32(x.float().contiguous(), packed.contiguous(), wsum.contiguous(), n,
                                        None if row_max is None else row_max.float().contiguous())
    return w8a8_int32_ref(x.float(), unpack(packed, n, x.shape[-1]), row_max)


def w8a8_int32_ref(rows: torch.Tensor, weight: torch.Tensor, row_max: torch.Tensor | None = None) -> torch.Tensor:
    """rows [M, K] float32, weight int8 [N, K] -> int32 [M, N], the reference of `w8a8_int32`."""
    q, _ = quantize_rows_ref(rows, row_max)
    if rows.device.type != "cpu":  # no int32 matmul there; float64 holds these sums (|s| < 2^31) exactly
        return (q.double() @ weight.double().t()).to(torch.int32)
    return torch._int_mm(q, weight.t()) if weight.shape[1] > 1 else q.int() @ weight.int().t()


def w8a8_epilogue(sums: torch.Tensor, row_max: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """int32 sums [M, N], each row's max |x| [M, 1] -> float32 [M, N]: `w8a8_linear`'s epilogue in its order,
    ((float(sum) * x_scale) * scale) (+ bias)."""
    module = load() if cpu_kernels_enabled() and sums.device.type == "cpu" else None
    if module is not None:
        return module.w8a8_epilogue(sums.contiguous(), row_max.float().contiguous(), scale.float().contiguous(),
                                    None if bias is None else bias.float().contiguous())
    y = (sums.float() * row_scale(row_max)) * scale.float()
    return y if bias is None else y + bias.float()


def pack(weight_int8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, K] -> (packed int8 [ceil(N / 16), ceil(K / 4), 16, 4], wsum int32 [ceil(N / 16) * 16])."""
    if weight_int8.dim() != 2 or weight_int8.dtype != torch.int8:
        raise ValueError(f"expected an int8 [N, K] weight, got {weight_int8.dtype} {tuple(weight_int8.shape)}")
    n, k = weight_int8.shape
    blocks, groups = -(-n // BLOCK_N), -(-k // GROUP_K)
    padded = weight_int8.new_zeros(blocks * BLOCK_N, groups * GROUP_K)
    padded[:n, :k] = weight_int8
    packed = padded.view(blocks, BLOCK_N, groups, GROUP_K).transpose(1, 2).contiguous()
    return packed, padded.sum(dim=1, dtype=torch.int32)


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of `pack`'s first output: int8 [N, K]."""
    blocks, groups, _, _ = packed.shape
    return packed.transpose(1, 2).reshape(blocks * BLOCK_N, groups * GROUP_K)[:n, :k]


def _reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
               n: int) -> torch.Tensor:
    """`w8a8_linear` by the torch reference, from the packed weight."""
    k = x.shape[-1]
    y = w8a8_matmul_ref(x.reshape(-1, k).float(), unpack(packed, n, k), scale.float())
    return (y if bias is None else y + bias.float()).view(*x.shape[:-1], n)


@torch.library.custom_op("ladder::w8a8_linear", mutates_args=())
def _w8a8_linear_op(x: torch.Tensor, packed: torch.Tensor, wsum: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None, n: int) -> torch.Tensor:
    # Loading the C++ library registers its CPU kernel for this op, which the dispatcher prefers from then
    # on: this body runs where that kernel is missing (and on other devices).
    module = load() if cpu_kernels_enabled() and x.device.type == "cpu" else None
    k = x.shape[-1]
    if module is not None:
        out = module.w8a8_linear(x.reshape(-1, k).float().contiguous(), packed.contiguous(), wsum.contiguous(),
                                 scale.float().contiguous(), None if bias is None else bias.float().contiguous(), n)
        return out.view(*x.shape[:-1], n)
    return _reference(x, packed, scale, bias, n)


@_w8a8_linear_op.register_fake
def _(x, packed, wsum, scale, bias, n):
    return x.new_empty(x.shape[:-1] + (n,), dtype=torch.float32)


def w8a8_linear(x: torch.Tensor, packed: torch.Tensor, wsum: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """y [..., N] float32 = w8a8(x [..., K], weight) (+ bias) with `packed, wsum = pack(weight)`; equal bit
    for bit to `w8a8_matmul_ref(x, weight, scale) + bias`."""
    if not cpu_kernels_enabled() or x.device.type != "cpu":
        return _reference(x, packed, scale, bias, n)
    load()  # registers the C++ kernel before the first dispatch
    return torch.ops.ladder.w8a8_linear(x, packed, wsum, scale, bias, n)


if __name__ == "__main__":
    import sys

    sys.exit(_extension.build_and_report())
