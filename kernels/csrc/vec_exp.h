// exp(x) on 16 (AVX-512) or 8 (AVX2 + FMA) float32 lanes, shared by the kernels whose results must not
// depend on which source computed them (the gated activations of fused_ops.cpp, the sampler's weights in
// sampling.cpp), and by the decode attention's softmax.
#pragma once

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cmath>

namespace ladder {

#ifdef __AVX512F__
// exp(x) as 2^k * e^r, k = round(x / ln 2) and r = x - k ln 2 (|r| <= ln(2) / 2, ln 2 in two parts), e^r
// by its Taylor series to degree 7 (relative error under 1e-8). x is clamped to [-87, 100]: below, the
// result stays at e^-87 (about 1.6e-38; a caller that needs 0 there masks it), and above 88.7 the scaling
// overflows to inf as exp does. A NaN stays NaN through the caller's use of x itself.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(100.f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 e = _mm512_set1_ps(1.f / 5040);
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f / 720));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f / 120));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f / 24));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f / 6));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(0.5f));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f));
  e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(e, k);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// exp16's arithmetic on 8 lanes, 2^k built in the exponent bits (k in [-126, 127], x clamped to [-87, 88]);
// above 88.72 the result is inf, as exp's.
inline __m256 exp8(__m256 x_in) {
  const __m256 x = _mm256_min_ps(_mm256_max_ps(x_in, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 e = _mm256_set1_ps(1.f / 5040);
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f / 720));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f / 120));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f / 24));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f / 6));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(0.5f));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f));
  e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(1.f));
  const __m256i two_k = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  const __m256 overflow = _mm256_cmp_ps(x_in, _mm256_set1_ps(88.72284f), _CMP_GT_OQ);
  return _mm256_blendv_ps(_mm256_mul_ps(e, _mm256_castsi256_ps(two_k)), _mm256_set1_ps(INFINITY), overflow);
}
#endif

}  // namespace ladder
