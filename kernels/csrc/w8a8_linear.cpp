// W8A8 linear: int8 weights times int8 activations quantized per row on the fly, exact int32 sums.
// y [M, N] = (int32(q [M, K] @ w [N, K].T) * x_scale [M, 1]) * w_scale [N] (+ bias), each row of x
// quantized symmetrically: x_scale = max(max|x_row|, 1e-12) / 127, q = round(x / x_scale) (half to even).
// AVX-512 VNNI's vpdpbusd takes unsigned activations: rows are stored as q + 128 and 128 * sum_k w[n, k]
// (`wsum`, computed at packing) is subtracted from the sums; the portable loop does the same. The AVX2
// tiles take q itself, signed (see their vpmaddubsw's bound), and need no `wsum`.
// Packed weight: [NBLK, KG, 16, 4] int8, 16 output channels by groups of 4 input channels per block.
#include <torch/library.h>

#include <cmath>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "cpu_kernels.h"
#include "parallel.h"
#include "tile.h"

// Bit-equal to the torch reference: no multiply-add contraction of the epilogue's (y * s) + bias.
#pragma GCC optimize("fp-contract=off")

namespace ladder {
namespace {

constexpr int GK = 4;  // input channels per vpdpbusd lane

// What a row's bytes hold: q + 128 for vpdpbusd and the portable loop, q (as its low byte) for the AVX2 tiles.
#ifdef LADDER_AVX2_INT8
constexpr int32_t kOffset = 0;
#else
constexpr int32_t kOffset = 128;
#endif

// A row's scale from its max |x|: the reference's clamp, then / 127.
inline float row_scale(float amax) { return std::max(amax, 1e-12f) / 127.f; }

// Row x [K] -> q + kOffset as uint8 into xq [KP] (KP = K rounded up to GK, padded with kOffset, i.e. q = 0)
// and its scale. The arithmetic is the reference's: amax, clamp, / 127, x / scale, round to even.
// `given_amax`: the row's max |x| taken over more columns than these K (a row-parallel rank's part).
void quantize_row(const float* x, int64_t K, int64_t KP, uint8_t* xq, float* x_scale, const float* given_amax) {
  float amax = 0.f;
  if (given_amax) {
    amax = *given_amax;
  } else {
#ifdef LADDER_AVX2_INT8
    amax = max_abs(x, K);
#else
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
#endif
  }
  const float s = row_scale(amax);
  *x_scale = s;
  int64_t k = 0;
#ifdef LADDER_VNNI
  const __m512 vs = _mm512_set1_ps(s);
  const __m512i offset = _mm512_set1_epi32(128);
  for (; k + 16 <= K; k += 16) {
    __m512 v = _mm512_div_ps(_mm512_loadu_ps(x + k), vs);
    __m512i q = _mm512_add_epi32(_mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), offset);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + k), _mm512_cvtepi32_epi8(q));
  }
#elif defined(LADDER_AVX2_INT8)
  // vcvtps2dq rounds in the current mode as nearbyint does (half to even); the low byte is the scalar
  // loop's uint8 cast.
  const __m256 vs = _mm256_set1_ps(s);
  const __m256i low = _mm256_set1_epi32(0xFF);
  for (; k + 8 <= K; k += 8) {
    const __m256i q = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(x + k), vs));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(xq + k), bytes8(_mm256_and_si256(q, low)));
  }
#endif
  for (; k < K; ++k) xq[k] = static_cast<uint8_t>(static_cast<int32_t>(std::nearbyint(x[k] / s)) + kOffset);
  for (; k < KP; ++k) xq[k] = static_cast<uint8_t>(kOffset);
}

// RAW: `out` is int32 and takes the exact integer sums, sum_k q w, without the float epilogue.
template <bool RAW>
struct W8A8Tiles {
  using Fn = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, const int32_t*, const float*,
                      const float*, const float*, void*, int64_t, int64_t, int64_t);
#ifdef LADDER_AVX2_INT8
  // Two int32 accumulators per row and block (8 channels each) beside the block's two weight vectors and
  // their magnitudes, the broadcast row and the ones: 4 rows of one block (8 + 4 + 2), or one row of two
  // blocks, in the 16 ymm registers without spills.
  static constexpr int kMaxMr = 4;
  static constexpr int kMaxNb[kMaxMr + 1] = {0, 2, 1, 1, 1};
  // Groups of 4 inputs (one 64-byte line of each block's weights) prefetched ahead in each block: Gemma
  // 3's layers 12% faster in a decode step. (The VNNI tiles read up to 8 blocks side by side, which the
  // hardware prefetcher follows: prefetching there measured no faster.)
  static constexpr int64_t kAhead = 16;
#else
  static constexpr int kMaxMr = 8;
  static constexpr int kMaxNb[kMaxMr + 1] = {0, 8, 6, 4, 4, 4, 3, 3, 3};
#endif

#ifdef LADDER_VNNI
  // MR rows times NB consecutive blocks of 16 output channels, over all KG groups of 4 input channels.
  template <int MR, int NB>
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
      const __mmask16 mask = tail_mask(N - col);
      const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(wsum + col), 7);  // 128 * sum_k w
      if constexpr (RAW) {
        int32_t* out = static_cast<int32_t*>(out_);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i)
          _mm512_mask_storeu_epi32(out + i * ldo + col, mask, _mm512_sub_epi32(acc[i][j], offset));
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
#elif defined(LADDER_AVX2_INT8)
  // MR rows times NB consecutive blocks of 16 output channels, over all KG groups of 4 input channels; a
  // group's 64 bytes are two vectors of 8 channels by 4 inputs. vpmaddubsw multiplies unsigned by signed
  // bytes, so it takes |w| and q with w's sign (vpsignb): |w| <= 128 (w = -128 included: vpabsb's 0x80
  // read unsigned) and |q| <= 127 (|x / x_scale| <= 127, x_scale >= max |x| / 127) bound each int16
  // pair sum by 2 * 128 * 127 = 32512 < 32767, so nothing saturates and the sums are exact. vpmaddwd by
  // ones adds the two pairs of a channel's 4 inputs into its int32 lane, as one vpdpbusd lane does.
  template <int MR, int NB>
  static void tile(const uint8_t* __restrict xq, int64_t ldq, const int8_t* __restrict w, int64_t KG,
                   const int32_t* __restrict, const float* __restrict xs, const float* __restrict scale,
                   const float* __restrict bias, void* __restrict out_, int64_t ldo, int64_t n0, int64_t N) {
    constexpr int V = 2 * NB;  // vectors of 8 output channels
    __m256i acc[MR][V];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[i][v] = _mm256_setzero_si256();
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t bstride = KG * BN * GK;
    for (int64_t g = 0; g < KG; ++g) {
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + j * bstride + (g + kAhead) * BN * GK), _MM_HINT_T0);
      __m256i wv[V], wa[V];
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) {
        const int8_t* wg = w + (v / 2) * bstride + g * BN * GK + (v % 2) * 32;
        wv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg));
        wa[v] = _mm256_abs_epi8(wv[v]);
      }
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        int32_t four;
        std::memcpy(&four, xq + i * ldq + g * GK, sizeof(four));
        const __m256i xv = _mm256_set1_epi32(four);
#pragma GCC unroll 8
        for (int v = 0; v < V; ++v)
          acc[i][v] = _mm256_add_epi32(
              acc[i][v], _mm256_madd_epi16(_mm256_maddubs_epi16(wa[v], _mm256_sign_epi8(xv, wv[v])), ones));
      }
    }
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) {
      const int64_t col = n0 + v * 8;
      if (col >= N) break;
      const bool full = N - col >= 8;
      const __m256i mask = tail_mask8(N - col);
      if constexpr (RAW) {
        int32_t* out = static_cast<int32_t*>(out_);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          int32_t* o = out + i * ldo + col;
          if (full) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), acc[i][v]);
          } else {
            _mm256_maskstore_epi32(o, mask, acc[i][v]);
          }
        }
        continue;
      }
      float* out = static_cast<float*>(out_);
      const __m256 s = full ? _mm256_loadu_ps(scale + col) : _mm256_maskload_ps(scale + col, mask);
      const __m256 b = !bias ? _mm256_setzero_ps()
                       : full ? _mm256_loadu_ps(bias + col) : _mm256_maskload_ps(bias + col, mask);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        // ((float)sum * x_scale) * w_scale (+ bias): the reference's order, no fused multiply-add.
        __m256 y = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[i][v]), _mm256_set1_ps(xs[i])), s);
        if (bias) y = _mm256_add_ps(y, b);
        if (full) {
          _mm256_storeu_ps(out + i * ldo + col, y);
        } else {
          _mm256_maskstore_ps(out + i * ldo + col, mask, y);
        }
      }
    }
  }
#else
  template <int MR, int NB>
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
};

#if defined(LADDER_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define LADDER_AMX 1
// --- AMX: many rows at once (a prefill's, a batch of embeddings') on Intel's tile units.
//
// tdpbusd multiplies a tile of 16 rows by 64 bytes of the rows' q + 128 with a tile of 16 groups of 4
// inputs by 16 output channels, which is one packed block's layout for 64 inputs: 16 x 16 exact int32
// sums, the sums vpdpbusd makes. The VNNI tiles' epilogue then runs on them unchanged, so every output has
// the VNNI tiles' bits (and so a row's output is the same alone, on VNNI tiles, or in a prefill, on AMX).
// Used for M >= kAmxMinRows when K (rounded up to 4) is a multiple of 64, after the process was granted
// the tile state (Linux's arch_prctl), on CPUs that report AMX-INT8.

// From 8 rows the tiles beat the VNNI tiles (K 576-2048, N 640-2048: 0.9-0.6x the time at 8-16 rows, about
// 0.5x from 32); below, a decode's few rows stream the weights on the VNNI tiles faster (1.2-1.5x at 1 row).
constexpr int64_t kAmxMinRows = 8;
constexpr int64_t kAmxK = 64;  // bytes of a row per tile: 64 inputs, 16 groups of 4

struct TileConfig {  // ldtilecfg's 64-byte layout, palette 1
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_ready() {
  static const bool ready = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) || !(edx & (1u << 25))) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ready;
}

// Tiles: C 0..3 (rows 0-15 and 16-31 by blocks b and b + 1), A 4, 5 (the two row groups), B 6, 7 (the blocks).
void load_tile_config() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// RG groups of 16 rows from m0 (xq has rows up to there, padded) by NB blocks from b: the int32 sums into
// sums [32][32] (row, then the two blocks' 16 channels).
template <int RG, int NB>
void amx_unit(const uint8_t* xq, int64_t KP, const int8_t* wp, int64_t b, int32_t* sums) {
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (RG == 2) {
    _tile_zero(1);
    _tile_zero(3);
  }
  const int8_t* w0 = wp + b * KP * BN;
  const int8_t* w1 = w0 + KP * BN;
  for (int64_t k = 0; k < KP; k += kAmxK) {
    _tile_loadd(4, xq + k, KP);
    _tile_loadd(6, w0 + k * BN, 64);
    _tile_dpbusd(0, 4, 6);
    if constexpr (NB == 2) {
      _tile_loadd(7, w1 + k * BN, 64);
      _tile_dpbusd(2, 4, 7);
    }
    if constexpr (RG == 2) {
      _tile_loadd(5, xq + 16 * KP + k, KP);
      _tile_dpbusd(1, 5, 6);
      if constexpr (NB == 2) _tile_dpbusd(3, 5, 7);
    }
  }
  _tile_stored(0, sums, 32 * 4);
  if constexpr (NB == 2) _tile_stored(2, sums + 16, 32 * 4);
  if constexpr (RG == 2) {
    _tile_stored(1, sums + 16 * 32, 32 * 4);
    if constexpr (NB == 2) _tile_stored(3, sums + 16 * 32 + 16, 32 * 4);
  }
}

// The VNNI tiles' epilogue (W8A8Tiles<RAW>::tile) on rows m0 .. m0 + mr of the sums of blocks b .. b + nb.
template <bool RAW>
void amx_epilogue(const int32_t* sums, int64_t mr, int nb, const int32_t* wsum, const float* xs, const float* scale,
                  const float* bias, void* out_, int64_t ldo, int64_t b, int64_t N) {
  for (int j = 0; j < nb; ++j) {
    const int64_t col = (b + j) * BN;
    if (col >= N) break;
    const __mmask16 mask = tail_mask(N - col);
    const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(wsum + col), 7);  // 128 * sum_k w
    const __m512 s = RAW ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, scale + col);
    const __m512 bv = bias && !RAW ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int64_t i = 0; i < mr; ++i) {
      const __m512i sum = _mm512_sub_epi32(_mm512_loadu_si512(sums + i * 32 + j * 16), offset);
      if constexpr (RAW) {
        _mm512_mask_storeu_epi32(static_cast<int32_t*>(out_) + i * ldo + col, mask, sum);
      } else {
        __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(xs[i])), s);
        if (bias) y = _mm512_add_ps(y, bv);
        _mm512_mask_storeu_ps(static_cast<float*>(out_) + i * ldo + col, mask, y);
      }
    }
  }
}

// Every row of xq [Mpad, KP] (Mpad: M rounded up to 16, the padding rows zeros) by every block, threads
// sharing units of 32 rows (16 for a last group of at most 16) by 2 blocks, the blocks outer so that a
// pair's weights stay in L1 over the rows.
template <bool RAW>
void amx_rows(const uint8_t* xq, int64_t M, int64_t KP, const int8_t* wp, const int32_t* wsum, int64_t NBLK,
              const float* xs, const float* scale, const float* bias, void* out, int64_t N) {
  const int64_t row_groups = (M + 31) / 32, pairs = (NBLK + 1) / 2;
  parallel_for(0, pairs * row_groups, 1, [&](int64_t u0, int64_t u1) {
    load_tile_config();  // per thread and call: another library may have configured the tiles its own way
    alignas(64) int32_t sums[32 * 32];
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = (u / row_groups) * 2, m0 = (u % row_groups) * 32;
      const int nb = static_cast<int>(std::min<int64_t>(2, NBLK - b));
      const uint8_t* xr = xq + m0 * KP;
      if (M - m0 > 16) {
        nb == 2 ? amx_unit<2, 2>(xr, KP, wp, b, sums) : amx_unit<2, 1>(xr, KP, wp, b, sums);
      } else {  // a last group of at most 16 rows
        nb == 2 ? amx_unit<1, 2>(xr, KP, wp, b, sums) : amx_unit<1, 1>(xr, KP, wp, b, sums);
      }
      amx_epilogue<RAW>(sums, std::min<int64_t>(32, M - m0), nb, wsum, xs + m0, scale, bias,
                        static_cast<uint8_t*>(out) + 4 * m0 * N, N, b, N);
    }
    _tile_release();
  });
}
#endif

// The product of rows xp [M, K] (K <= KG * GK) with a packed weight into out (4-byte elements, float32, or
// with `raw` the int32 sums), the rows quantized with their own max |x| or `given` maxima [M].
void rows(const float* xp, int64_t M, int64_t K, const int8_t* wp, const int32_t* sump, int64_t NBLK, int64_t KG,
          const float* sp, const float* bp, int64_t N, bool raw, const float* given, void* out, W8A8Scratch& scratch) {
  if (M == 0 || N == 0) return;
  const int64_t KP = KG * GK;
  std::vector<uint8_t>& xq = scratch.xq;
  std::vector<float>& xs = scratch.xs;
#ifdef LADDER_AMX
  const bool amx = M >= kAmxMinRows && KP % kAmxK == 0 && amx_ready();
  const int64_t rows_held = amx ? (M + 15) / 16 * 16 : M;
  xq.resize(rows_held * KP);
  if (amx) std::fill(xq.begin() + M * KP, xq.end(), uint8_t{0});  // the last row group's padding: zero sums
#else
  xq.resize(M * KP);
#endif
  xs.resize(M);
  if (M == 1) {  // a decode row: no task for so little work
    quantize_row(xp, K, KP, xq.data(), xs.data(), given);
  } else {
    parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        quantize_row(xp + m * K, K, KP, xq.data() + m * KP, xs.data() + m, given ? given + m : nullptr);
    });
  }
#ifdef LADDER_AMX
  if (amx) {
    if (raw) {
      amx_rows<true>(xq.data(), M, KP, wp, sump, NBLK, xs.data(), sp, bp, out, N);
    } else {
      amx_rows<false>(xq.data(), M, KP, wp, sump, NBLK, xs.data(), sp, bp, out, N);
    }
    return;
  }
#endif
  uint8_t* op = static_cast<uint8_t*>(out);
  auto call = [&](auto tile, int64_t m, int64_t b) {
    tile(xq.data() + m * KP, KP, wp + b * KP * BN, KG, sump, xs.data() + m, sp, bp, op + 4 * m * N, N, b * BN, N);
  };
  if (raw) {
    for_each_tile<W8A8Tiles<true>>(M, NBLK, M * KP * BN, 262144, call);
  } else {
    for_each_tile<W8A8Tiles<false>>(M, NBLK, M * KP * BN, 262144, call);
  }
}

// x [M, K] float32 contiguous CPU; packed [NBLK, KG, 16, 4] int8; wsum [NBLK * 16] int32; scale [N]
// float32 (ignored with `raw`); bias [N] float32 or none. Returns [M, N] float32, or with `raw` the int32
// sums sum_k q w (a row-parallel layer sums them over its ranks exactly first). `row_max` [M] float32, if
// given, is each row's max |x| to quantize with instead of the row's own.
at::Tensor run(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& wsum, const float* sp,
               const float* bp, int64_t N, bool raw, const std::optional<at::Tensor>& row_max) {
  check_rows(x);
  TORCH_CHECK(packed.device().is_cpu() && packed.dim() == 4 && packed.scalar_type() == at::kChar &&
              packed.is_contiguous() && packed.size(2) == BN && packed.size(3) == GK, "packed: [NBLK, KG, 16, 4] int8");
  const int64_t M = x.size(0), K = x.size(1), NBLK = packed.size(0), KG = packed.size(1);
  TORCH_CHECK(KG == (K + GK - 1) / GK, "packed holds ", KG * GK, " input channels, x has ", K);
  check_blocks(N, NBLK);
  TORCH_CHECK(wsum.device().is_cpu() && wsum.scalar_type() == at::kInt && wsum.is_contiguous() &&
              wsum.numel() == NBLK * BN, "wsum: [NBLK * 16] int32");
  const float* given = optional_vector_data(row_max, M, "row_max");
  auto out = at::empty({M, N}, x.options().dtype(raw ? at::kInt : at::kFloat));
  W8A8Scratch scratch;
  rows(x.data_ptr<float>(), M, K, packed.data_ptr<int8_t>(), wsum.data_ptr<int32_t>(), NBLK, KG, sp, bp, N, raw, given,
       out.data_ptr(), scratch);
  return out;
}

// ladder::w8a8_linear: x [..., K] float32 or bfloat16 -> [..., n] float32.
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& wsum, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, int64_t n) {
  const auto s = scale.to(at::kFloat).contiguous();
  const auto b = float_vector(bias);
  auto out = run(float_rows(x), packed.contiguous(), wsum.contiguous(), vector_data(s, n, "scale"),
                 optional_vector_data(b, n, "bias"), n, false, std::nullopt);
  return out.view(sizes_with_last(x, n));
}

// ladder::w8a8_int32: x [M, K] -> int32 [M, n], sum_k q[m, k] w[n, k] with x's rows quantized as
// `w8a8_linear` does (with the scale of `row_max`'s maxima [M] when given).
at::Tensor w8a8_int32(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& wsum, int64_t n,
                      const std::optional<at::Tensor>& row_max) {
  return run(float_rows(x), packed.contiguous(), wsum.contiguous(), nullptr, nullptr, n, true,
             float_vector(row_max));
}

// ladder::w8a8_epilogue: the raw tiles' float epilogue on summed int32 sums [M, N]:
// ((float)sum * row_scale(row_max[m])) * scale[n] (+ bias[n]), the fused kernel's arithmetic in its order,
// so a row-parallel layer's result is its bits.
at::Tensor w8a8_epilogue(const at::Tensor& sums, const at::Tensor& row_max, const at::Tensor& scale,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(sums.device().is_cpu() && sums.dim() == 2 && sums.scalar_type() == at::kInt, "sums: [M, N] int32");
  const auto s32 = sums.contiguous();
  const int64_t M = s32.size(0), N = s32.size(1);
  const auto maxima = row_max.to(at::kFloat).contiguous(), s = scale.to(at::kFloat).contiguous();
  const auto b = float_vector(bias);
  const float* mp = vector_data(maxima, M, "row_max");
  const float* wp = vector_data(s, N, "scale");
  const float* bp = optional_vector_data(b, N, "bias");
  auto out = at::empty({M, N}, s32.options().dtype(at::kFloat));
  const int32_t* sp = s32.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float xs = row_scale(mp[m]);
    for (int64_t j = 0; j < N; ++j) {
      const float y = (static_cast<float>(sp[m * N + j]) * xs) * wp[j];
      op[m * N + j] = bp ? y + bp[j] : y;
    }
  }
  return out;
}

}  // namespace

void w8a8_rows(const float* x, int64_t M, const W8A8Weight& w, float* out, W8A8Scratch& scratch) {
  const int64_t KG = (w.K + GK - 1) / GK;
  rows(x, M, w.K, w.packed, w.wsum, w.NBLK, KG, w.scale, w.bias, w.N, false, nullptr, out, scratch);
}

}  // namespace ladder

TORCH_LIBRARY_IMPL(ladder, CPU, m) {
  m.impl("w8a8_linear", &ladder::w8a8_linear);
  m.impl("w8a8_int32", &ladder::w8a8_int32);
  m.impl("w8a8_epilogue", &ladder::w8a8_epilogue);
}
