// Weight-only INT8 linear: y [M, N] = x [M, K] @ (w * scale[:, None]).T (+ bias), float32 accumulation.
// Packed weight: [NBLK, K, 16] int8, block b holds output channels 16b .. 16b+15 (zero rows past N).
#include <torch/library.h>

#include "tile.h"

namespace ladder {
namespace {

struct Int8Tiles {
  using Fn = void (*)(const float*, int64_t, const int8_t*, int64_t, const float*, const float*, float*,
                      int64_t, int64_t, int64_t);
  static constexpr int kMaxMr = 8;
  static constexpr int kMaxNb[kMaxMr + 1] = {0, 8, 6, 4, 4, 4, 3, 3, 3};

#ifdef __AVX512F__
  // MR rows of x times NB consecutive blocks of 16 output channels, over the whole of K: one k widens 16
  // int8 weights per block to floats and multiplies them into the MR rows' accumulators.
  template <int MR, int NB>
  static void tile(const float* __restrict x, int64_t ldx, const int8_t* __restrict w, int64_t K,
                   const float* __restrict scale, const float* __restrict bias, float* __restrict out,
                   int64_t ldo, int64_t n0, int64_t N) {
    __m512 acc[MR][NB];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
    const int64_t bstride = K * BN;
    for (int64_t k = 0; k < K; ++k) {
      __m512 wv[NB];
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j)
        wv[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * bstride + k * BN))));
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const __m512 xv = _mm512_set1_ps(x[i * ldx + k]);
#pragma GCC unroll 8
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      const int64_t col = n0 + j * BN;
      if (col >= N) break;
      const __mmask16 mask = tail_mask(N - col);
      const __m512 s = _mm512_maskz_loadu_ps(mask, scale + col);
      const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i)
        _mm512_mask_storeu_ps(out + i * ldo + col, mask, _mm512_fmadd_ps(acc[i][j], s, b));
    }
  }
#else
  template <int MR, int NB>
  static void tile(const float* __restrict x, int64_t ldx, const int8_t* __restrict w, int64_t K,
                   const float* __restrict scale, const float* __restrict bias, float* __restrict out,
                   int64_t ldo, int64_t n0, int64_t N) {
    float acc[MR][NB * BN] = {};
    const int64_t bstride = K * BN;
    for (int64_t k = 0; k < K; ++k)
      for (int j = 0; j < NB; ++j) {
        const int8_t* wk = w + j * bstride + k * BN;
        for (int i = 0; i < MR; ++i) {
          const float xv = x[i * ldx + k];
          for (int c = 0; c < BN; ++c) acc[i][j * BN + c] += xv * static_cast<float>(wk[c]);
        }
      }
    for (int j = 0; j < NB * BN; ++j) {
      const int64_t col = n0 + j;
      if (col >= N) break;
      for (int i = 0; i < MR; ++i) out[i * ldo + col] = acc[i][j] * scale[col] + (bias ? bias[col] : 0.f);
    }
  }
#endif
};

// x [M, K] float32 contiguous; packed [NBLK, K, 16] int8; scale [N] float32; bias [N] float32 or none.
// Returns [M, N] float32.
at::Tensor int8_linear_rows(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                            const std::optional<at::Tensor>& bias, int64_t N) {
  check_rows(x);
  TORCH_CHECK(packed.device().is_cpu() && packed.dim() == 3 && packed.scalar_type() == at::kChar &&
              packed.is_contiguous() && packed.size(2) == BN, "packed: [NBLK, K, 16] int8");
  const int64_t M = x.size(0), K = x.size(1), NBLK = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "packed K ", packed.size(1), " != x K ", K);
  check_blocks(N, NBLK);
  const float* sp = vector_data(scale, N, "scale");
  const float* bp = optional_vector_data(bias, N, "bias");
  auto out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  float* op = out.data_ptr<float>();
  for_each_tile<Int8Tiles>(M, NBLK, M * K * BN, 65536, [&](Int8Tiles::Fn tile, int64_t m, int64_t b) {
    tile(xp + m * K, K, wp + b * K * BN, K, sp, bp, op + m * N, N, b * BN, N);
  });
  return out;
}

// ladder::int8_linear: x [..., K] float32 or bfloat16 -> [..., n] of x's dtype, computed in float32.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, int64_t n) {
  auto out = int8_linear_rows(float_rows(x), packed.contiguous(), scale.to(at::kFloat).contiguous(),
                              float_vector(bias), n);
  return out.view(sizes_with_last(x, n)).to(x.scalar_type());
}

}  // namespace
}  // namespace ladder

TORCH_LIBRARY_IMPL(ladder, CPU, m) { m.impl("int8_linear", &ladder::int8_linear); }
