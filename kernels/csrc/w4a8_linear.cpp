// W4A8 linear over a GGUF's own quantized blocks: 4-bit (Q4_0, Q4_1, Q4_K), 5-bit (Q5_0, Q5_1, Q5_K), 6-bit
// (Q6_K) or 8-bit (Q8_0) weight codes times int8 activations quantized per 32-block. The weight of output n
// over input block b is w = d[n, b] * u + m[n, b] (u an unsigned code, d and m float16); m is implied (m =
// -zero * d) when the scales hold d only. 6-bit codes carry an int8 sub-scale c per 16 inputs: w = d * c *
// (u - zero) (+ m). Bit-equal to its torch reference: every product and sum in the reference's order. Codes
// per 16 output channels and 32-block: 8-bit as [8 groups, 16, 4] bytes; 4-bit as [4, 16, 4] bytes whose
// low nibbles hold groups 0-3 and high nibbles groups 4-7; 5-bit as the 4-bit layout of the low four bits,
// then per group g (0-7) a 64-bit mask whose bit t is the fifth bit of byte t of that group's 64 (channel
// t / 4, input t % 4), so that one mask register adds 16 to the codes it marks; 6-bit as the 4-bit
// layout (four lines of 64 bytes), then two 64-byte vectors of bit pairs, byte t of vector p holding bits
// 4-5 of the codes of byte t in lines 2p and 2p + 1 (line 2p's low and high nibble's at bits 0-1 and 2-3,
// line 2p + 1's at 4-5 and 6-7), then the sub-scales as [16 channels, 2 halves] int8: a shift and a mask
// move 64 codes' high bits into place on either ISA. Table codes (kTableCodes: MXFP4, whose 16 values are
// integers times a power of two) as the 4-bit layout of their indices, then the block's 16-byte table: one
// byte shuffle a line turns the indices into the 8-bit codes, w = d * (table[i] - zero).
// The integer sums run on AVX-512 VNNI's vpdpbusd, else on AVX2's vpmaddubsw and vpmaddwd, else in the
// portable loop. With many rows (a prefill, a large batch) the VNNI and AVX2 paths widen narrow codes to bytes
// once per thread and block (widen_block, `widened`) instead of unpacking them in every row group's tile.
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"
#include "parallel.h"
#include "tile.h"

// Bit-equal to the torch reference: no multiply-add contraction anywhere.
#pragma GCC optimize("fp-contract=off")

namespace ladder {
namespace {

constexpr int QK = 32;  // input channels per quantization block
// Offsets in a block's codes: the 5-bit masks or the 6-bit pairs after the nibbles, then the sub-scales.
constexpr int kHighBits = 256, kSubScales = 384;
// A block's bytes widened for many rows (widen_block): 512 codes, then a 6-bit block's 32 sub-scales.
constexpr int64_t wide_bytes(int bits) { return bits == 6 ? 544 : 512; }
// The bits of 1.5 * 2^23: an integer v with |v| < 2^22 added to them is the float 1.5 * 2^23 + v, exactly.
constexpr int32_t kMagic = 0x4B400000;

// One row x [KB * 32] -> int8 xq, and per block its scale xs[b], xs[b] * sum(xq of the block) xc[b], that
// sum xsum[b] and the sum of the block's first 16 codes xlo[b].
void quantize_row_portable(const float* x, int64_t KB, int8_t* xq, float* xs, float* xc, int32_t* xsum,
                           int32_t* xlo) {
  for (int64_t b = 0; b < KB; ++b) {
    const float* xb = x + b * QK;
    float amax = 0.f;
    for (int k = 0; k < QK; ++k) amax = std::max(amax, std::fabs(xb[k]));
    const float s = std::max(amax, 1e-12f) / 127.f;
    int32_t sum = 0;
    for (int k = 0; k < QK; ++k) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(xb[k] / s));
      xq[b * QK + k] = static_cast<int8_t>(q);
      sum += q;
      if (k == QK / 2 - 1) xlo[b] = sum;
    }
    xs[b] = s;
    xc[b] = s * static_cast<float>(sum);
    xsum[b] = sum;
  }
}

#ifdef LADDER_VNNI
void quantize_row(const float* x, int64_t KB, int8_t* xq, float* xs, float* xc, int32_t* xsum, int32_t* xlo) {
  const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t b = 0; b < KB; ++b) {
    const __m512 lo = _mm512_loadu_ps(x + b * QK), hi = _mm512_loadu_ps(x + b * QK + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float s = std::max(amax, 1e-12f) / 127.f;
    const __m512 vs = _mm512_set1_ps(s);
    const __m512i qlo = _mm512_cvt_roundps_epi32(_mm512_div_ps(lo, vs), rnd);
    const __m512i qhi = _mm512_cvt_roundps_epi32(_mm512_div_ps(hi, vs), rnd);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * QK), _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * QK + 16), _mm512_cvtepi32_epi8(qhi));
    const int32_t first = _mm512_reduce_add_epi32(qlo), sum = first + _mm512_reduce_add_epi32(qhi);
    xs[b] = s;
    xc[b] = s * static_cast<float>(sum);
    xsum[b] = sum;
    xlo[b] = first;
  }
}
#elif defined(LADDER_AVX2_INT8)
// quantize_row_portable's arithmetic 8 lanes at a time: vcvtps2dq rounds in the current mode as nearbyint
// does (half to even), the byte stored is the low byte of q as the int8 cast's, and the int32 sums do not
// depend on their order.
inline int32_t sum_lanes(__m256i v) {
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  h = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
  return _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 1)));
}

void quantize_row(const float* x, int64_t KB, int8_t* xq, float* xs, float* xc, int32_t* xsum, int32_t* xlo) {
  const __m256i low = _mm256_set1_epi32(0xFF);
  for (int64_t b = 0; b < KB; ++b) {
    const float* xb = x + b * QK;
    const float s = std::max(max_abs(xb, QK), 1e-12f) / 127.f;
    const __m256 vs = _mm256_set1_ps(s);
    __m256i half[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};  // inputs 0-15, 16-31
    for (int t = 0; t < QK; t += 8) {
      const __m256i q = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(xb + t), vs));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(xq + b * QK + t), bytes8(_mm256_and_si256(q, low)));
      half[t / 16] = _mm256_add_epi32(half[t / 16], q);
    }
    const int32_t lo = sum_lanes(half[0]), sum = lo + sum_lanes(half[1]);
    xs[b] = s;
    xc[b] = s * static_cast<float>(sum);
    xsum[b] = sum;
    xlo[b] = lo;
  }
}
#endif

#ifdef LADDER_VNNI
// A 32-block's codes of 16 channels, lines l = 0..3 of 64 bytes (4-, 5- or 6-bit layout) -> the bytes of
// groups l (inputs 4l .. 4l + 3, in lo) and 4 + l (inputs 16 + 4l .., in hi), as the 8-bit layout holds them.
template <int BITS>
inline void unpack_line(const uint8_t* block, int l, __m512i& lo, __m512i& hi) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i raw = _mm512_loadu_si512(block + l * 64);
  lo = _mm512_and_si512(raw, nibble);
  hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
  if constexpr (BITS == kTableCodes) {  // each index through the block's table (in every 128-bit lane)
    const __m128i entries = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kHighBits));
    const __m512i table = _mm512_broadcast_i32x4(entries);
    lo = _mm512_shuffle_epi8(table, lo);
    hi = _mm512_shuffle_epi8(table, hi);
  } else if constexpr (BITS == 5) {  // + 16 where the group's mask marks a fifth bit
    uint64_t flo, fhi;
    std::memcpy(&flo, block + kHighBits + l * 8, 8);
    std::memcpy(&fhi, block + kHighBits + (4 + l) * 8, 8);
    const __m512i sixteen = _mm512_set1_epi8(16);
    lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(flo), lo, sixteen);
    hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(fhi), hi, sixteen);
  } else if constexpr (BITS == 6) {  // | bits 4-5 from the line pair's vector (0xF8: a | (b & c))
    const __m512i pair = _mm512_set1_epi8(0x30);
    const __m512i h = _mm512_loadu_si512(block + kHighBits + (l / 2) * 64);
    const bool second = l % 2;  // its pairs at bits 4-5 and 6-7, else 0-1 and 2-3
    const __m512i at_lo = second ? h : _mm512_slli_epi16(h, 4);
    const __m512i at_hi = second ? _mm512_srli_epi16(h, 2) : _mm512_slli_epi16(h, 2);
    lo = _mm512_ternarylogic_epi32(lo, at_lo, pair, 0xF8);
    hi = _mm512_ternarylogic_epi32(hi, at_hi, pair, 0xF8);
  }
}

// One block's codes widened to the 8-bit layout (wide_bytes: 512 code bytes, then a 6-bit block's 32
// sub-scale bytes), for the tiles of many rows (w4a8_rows): a row group then reads bytes instead of
// unpacking every block again.
template <int BITS>
inline void widen_block(const uint8_t* block, uint8_t* wide) {
#pragma GCC unroll 4
  for (int l = 0; l < 4; ++l) {
    __m512i lo, hi;
    unpack_line<BITS>(block, l, lo, hi);
    _mm512_storeu_si512(wide + l * 64, lo);
    _mm512_storeu_si512(wide + (4 + l) * 64, hi);
  }
  if constexpr (BITS == 6) std::memcpy(wide + 512, block + kSubScales, 32);
}

// BITS: the codes' width, and so the block sums' epilogue (6-bit: a sum per half and its sub-scale).
// WIDE: the codes come widened by widen_block (wide_bytes a block), else packed (w4a8_code_bytes).
template <int BITS, bool WIDE = false>
struct W4A8Tiles {
  using Fn = void (*)(const int8_t*, int64_t, const float*, const float*, const int32_t*, const int32_t*, int64_t,
                      const uint8_t*, const uint16_t*, int, int32_t, const float*, float*, int64_t, int64_t, int64_t,
                      int64_t, int64_t, bool);
  static constexpr int kMaxMr = 4;
  // Two accumulators per output (int32 block sums, float32 totals): 2 * MR * NB of the 32 registers; 6-bit
  // codes sum each half of a block apart (its own sub-scale): 3 * MR * NB.
  static constexpr int kMaxNb[kMaxMr + 1] = {0, 6, BITS == 6 ? 3 : 4, BITS == 6 ? 2 : 3, BITS == 6 ? 2 : 3};
  // 32-blocks prefetched ahead in each block's codes: about 0.25 us ahead of the loads at this host's
  // pace (a tile consumes 6 blocks' 1.5 kB a 32-block step); 8 ahead measured no faster, none 10% slower.
  static constexpr int64_t kAhead = 4;

  // MR rows times NB consecutive blocks of 16 output channels, over `blocks` blocks of 32 input channels (KB:
  // the rows' blocks, their stride in xs, xc, xsum and xlo; a chunk's pointers start at its first block).
  // codes: the first block's codes, each block `cstride` bytes on; scales: its float16 d (and m), KB * S * 16
  // each. resume: the sums continue from out's (a chunk after the first), else from zero.
  template <int MR, int NB>
  static void tile(const int8_t* __restrict xq, int64_t K, const float* __restrict xs, const float* __restrict xc,
                   const int32_t* __restrict xsum, const int32_t* __restrict xlo, int64_t KB,
                   const uint8_t* __restrict codes,
                   const uint16_t* __restrict scales, int S, int32_t zero,
                   const float* __restrict bias, float* __restrict out, int64_t ldo, int64_t n0, int64_t N,
                   int64_t blocks, int64_t cstride, bool resume) {
    constexpr int64_t CB = WIDE ? wide_bytes(BITS) : w4a8_code_bytes(BITS);
    constexpr int64_t kSub = WIDE ? 512 : kSubScales;
    __m512 y[MR][NB];
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      const int64_t col = n0 + j * BN;
      const __mmask16 mask = resume && col < N ? tail_mask(N - col) : 0;
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) y[i][j] = _mm512_maskz_loadu_ps(mask, out + i * ldo + col);
    }
    for (int64_t b = 0; b < blocks; ++b) {
      __m512i acc[MR][NB], acc_hi[MR][NB];  // acc_hi: 6-bit codes' inputs 16-31 (else all in acc)
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < NB; ++j) acc[i][j] = acc_hi[i][j] = _mm512_setzero_si512();
      const int8_t* xb = xq + b * QK;
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j)
#pragma GCC unroll 8
        for (int64_t line = 0; line < CB; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(codes + j * cstride + (b + kAhead) * CB + line), _MM_HINT_T0);
      if constexpr (BITS != 8 && !WIDE) {
#pragma GCC unroll 4
        for (int l = 0; l < 4; ++l) {
#pragma GCC unroll 8
          for (int j = 0; j < NB; ++j) {
            __m512i wlo, whi;  // groups l and 4 + l: inputs 4l .. 4l + 3 and 16 + 4l ..
            unpack_line<BITS>(codes + j * cstride + b * CB, l, wlo, whi);
#pragma GCC unroll 8
            for (int i = 0; i < MR; ++i) {
              int32_t a0, a1;
              std::memcpy(&a0, xb + i * K + 4 * l, 4);
              std::memcpy(&a1, xb + i * K + 16 + 4 * l, 4);
              acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], wlo, _mm512_set1_epi32(a0));
              __m512i& high = BITS == 6 ? acc_hi[i][j] : acc[i][j];
              high = _mm512_dpbusd_epi32(high, whi, _mm512_set1_epi32(a1));
            }
          }
        }
      } else {
#pragma GCC unroll 8
        for (int g = 0; g < 8; ++g) {
#pragma GCC unroll 8
          for (int j = 0; j < NB; ++j) {
            const __m512i w = _mm512_loadu_si512(codes + j * cstride + b * CB + g * 64);
#pragma GCC unroll 8
            for (int i = 0; i < MR; ++i) {
              int32_t a;
              std::memcpy(&a, xb + i * K + 4 * g, 4);
              __m512i& sum = BITS == 6 && g >= 4 ? acc_hi[i][j] : acc[i][j];
              sum = _mm512_dpbusd_epi32(sum, w, _mm512_set1_epi32(a));
            }
          }
        }
      }
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) {
        const uint16_t* sc = scales + (j * KB + b) * S * BN;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
        const __m512 m = S == 2 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + BN)))
                                : _mm512_setzero_ps();
        // 6-bit: the halves' sub-scales, per channel, as floats.
        __m512 c_lo = _mm512_setzero_ps(), c_hi = c_lo;
        if constexpr (BITS == 6) {
          const __m512i pairs = _mm512_cvtepi8_epi16(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j * cstride + b * CB + kSub)));
          c_lo = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(pairs, 16), 16));
          c_hi = _mm512_cvtepi32_ps(_mm512_srai_epi32(pairs, 16));
        }
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          // The exact integer sum the reference scales, as a float: sum (u - zero) a, each 6-bit half times its
          // c; where the scales hold m, sum u a (zero is 0 there but for 6-bit codes). A 6-bit half's sum is
          // at most 16 * 32 * 127 = 65024 and |c| <= 128, so each product and their sum are integers below
          // 2^24, exact in float32: the halves become floats by adding them to 1.5 * 2^23's bits and taking
          // 1.5 * 2^23 off as floats (exact below 2^22), and the sub-scales weigh them as floats, which
          // measured faster at 32 rows than vcvtdq2ps and vpmulld (w4a8_rows hands 6-bit tiles each half's
          // kMagic - zero * sum in xlo and xsum, read as memory broadcasts).
          __m512 q;
          if constexpr (BITS == 6) {
            const __m512 magic = _mm512_set1_ps(12582912.f);
            const __m512 q_lo = _mm512_sub_ps(
                _mm512_castsi512_ps(_mm512_add_epi32(acc[i][j], _mm512_set1_epi32(xlo[i * KB + b]))), magic);
            const __m512 q_hi = _mm512_sub_ps(
                _mm512_castsi512_ps(_mm512_add_epi32(acc_hi[i][j], _mm512_set1_epi32(xsum[i * KB + b]))), magic);
            q = _mm512_fmadd_ps(q_hi, c_hi, _mm512_mul_ps(q_lo, c_lo));
          } else {
            q = _mm512_cvtepi32_ps(S == 2 ? acc[i][j]
                                          : _mm512_sub_epi32(acc[i][j], _mm512_set1_epi32(zero * xsum[i * KB + b])));
          }
          const __m512 t = _mm512_mul_ps(_mm512_mul_ps(q, _mm512_set1_ps(xs[i * KB + b])), d);
          if (S == 2) {  // w = d u + m: (y + t) + m c
            y[i][j] = _mm512_add_ps(_mm512_add_ps(y[i][j], t), _mm512_mul_ps(m, _mm512_set1_ps(xc[i * KB + b])));
          } else {
            y[i][j] = _mm512_add_ps(y[i][j], t);
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      const int64_t col = n0 + j * BN;
      if (col >= N) break;
      const __mmask16 mask = tail_mask(N - col);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        __m512 v = y[i][j];
        if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + col));
        _mm512_mask_storeu_ps(out + i * ldo + col, mask, v);
      }
    }
  }
};
#elif defined(LADDER_AVX2_INT8)
// 16 where bit t of `mask` is set, in byte t of 32, else 0: a 5-bit weight's fifth bits, as a vector.
inline __m256i fifth_bits(uint32_t mask) {
  // Byte t takes byte t / 8 of the mask (vpshufb reads each 128-bit lane's copy), then tests its bit t % 8.
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(mask)), spread);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(16));
}

// Where vector `half` (channels 8 half .. + 7) of a 32-block's 4-, 5- or 6-bit codes keeps its high bits: its
// bits 32 half .. + 31 of each group's 64-bit mask (5-bit), its bytes 32 half .. + 31 of each pair vector
// (6-bit).
template <int BITS>
constexpr int64_t high_bits_at(int half) { return kHighBits + half * (BITS == 5 ? 4 : BITS == kTableCodes ? 0 : 32); }

// Line l = 0..3 of a vector's codes (`vec`: the block + 32 half; `high`: the block + high_bits_at(half)) -> the
// bytes of groups l (inputs 4l .. 4l + 3, in lo) and 4 + l (inputs 16 + 4l .., in hi), as the 8-bit layout
// holds them.
template <int BITS>
inline void unpack_half(const uint8_t* vec, const uint8_t* high, int l, __m256i& lo, __m256i& hi) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vec + l * 64));
  lo = _mm256_and_si256(raw, nibble);
  hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
  if constexpr (BITS == kTableCodes) {  // `high` is the block's table: each index through it
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(high)));
    lo = _mm256_shuffle_epi8(table, lo);
    hi = _mm256_shuffle_epi8(table, hi);
  } else if constexpr (BITS == 5) {
    uint32_t flo, fhi;
    std::memcpy(&flo, high + l * 8, 4);
    std::memcpy(&fhi, high + (4 + l) * 8, 4);
    lo = _mm256_or_si256(lo, fifth_bits(flo));
    hi = _mm256_or_si256(hi, fifth_bits(fhi));
  } else if constexpr (BITS == 6) {  // line l's pairs in vector l / 2: bits 0-3 (l even) or 4-7 (odd)
    const __m256i pair = _mm256_set1_epi8(0x30);
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high + (l / 2) * 64));
    const __m256i at_lo = l % 2 ? h : _mm256_slli_epi16(h, 4);
    const __m256i at_hi = l % 2 ? _mm256_srli_epi16(h, 2) : _mm256_slli_epi16(h, 2);
    lo = _mm256_or_si256(lo, _mm256_and_si256(at_lo, pair));
    hi = _mm256_or_si256(hi, _mm256_and_si256(at_hi, pair));
  }
}

// One block's codes widened to the 8-bit layout, as the VNNI path's widen_block (wide_bytes a block).
template <int BITS>
inline void widen_block(const uint8_t* block, uint8_t* wide) {
  for (int l = 0; l < 4; ++l) {
    for (int half = 0; half < 2; ++half) {
      __m256i lo, hi;
      unpack_half<BITS>(block + half * 32, block + high_bits_at<BITS>(half), l, lo, hi);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(wide + l * 64 + half * 32), lo);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(wide + (4 + l) * 64 + half * 32), hi);
    }
  }
  if constexpr (BITS == 6) std::memcpy(wide + 512, block + kSubScales, 32);
}

// Whether any of the VW vectors' block tables (tables[j] + at: 16 codes) holds a code past 31, which the int16
// sums of the 4-bit path cannot take (MXFP4's reach 24, IQ4's 241).
template <int VW>
inline bool wide_table(const uint8_t* const* tables, int64_t at) {
  bool wide = false;
#pragma GCC unroll 4
  for (int j = 0; j < VW; ++j) {
    const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tables[j] + at));
    wide |= !_mm_testz_si128(table, _mm_set1_epi8(static_cast<char>(0xE0)));
  }
  return wide;
}

// BITS and WIDE as for the VNNI tiles.
template <int BITS, bool WIDE = false>
struct W4A8Tiles {
  using Fn = void (*)(const int8_t*, int64_t, const float*, const float*, const int32_t*, const int32_t*, int64_t,
                      const uint8_t*, const uint16_t*, int, int32_t, const float*, float*, int64_t, int64_t, int64_t,
                      int64_t, int64_t, bool);
  // A tile walks VW 8-channel vectors side by side (kVectors[MR]): per row and vector one integer block
  // sum and one float32 total, beside a group's codes and the broadcast activations, which the VW vectors
  // share, in the 16 ymm registers. One row walks four vectors (two blocks of 16 channels) at once, so
  // each activation broadcast and each pass over the activations serves 32 channels.
  static constexpr int kMaxMr = 4;
  static constexpr int kVectors[kMaxMr + 1] = {0, 4, 2, 1, 1};
  static constexpr int kMaxNb[kMaxMr + 1] = {0, 2, 1, 1, 1};
  // 32-blocks prefetched ahead in each block's codes (two blocks' 512 B a step: 8 steps are about as far
  // ahead in time as the VNNI tiles' 4).
  static constexpr int64_t kAhead = 8;

  // MR rows times NB consecutive blocks of 16 output channels, over all KB blocks of 32 input channels, VW
  // vectors of 8 channels at a time: per 32-block the exact integer sum dot = sum_k u a of each row and
  // channel, then portable_block's float arithmetic in its order. codes and scales as the VNNI tiles take
  // them.
  template <int MR, int NB>
  static void tile(const int8_t* __restrict xq, int64_t K, const float* __restrict xs, const float* __restrict xc,
                   const int32_t* __restrict xsum, const int32_t* __restrict xlo, int64_t KB,
                   const uint8_t* __restrict codes,
                   const uint16_t* __restrict scales, int S, int32_t zero,
                   const float* __restrict bias, float* __restrict out, int64_t ldo, int64_t n0, int64_t N,
                   int64_t blocks, int64_t cstride, bool resume) {
    constexpr int64_t CB = WIDE ? wide_bytes(BITS) : w4a8_code_bytes(BITS);
    constexpr int64_t kSub = WIDE ? 512 : kSubScales;
    constexpr int VW = kVectors[MR] < 2 * NB ? kVectors[MR] : 2 * NB;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int v0 = 0; v0 < 2 * NB; v0 += VW) {
      if (n0 + v0 * 8 >= N) break;
      // Vector v's 32 bytes in each group's 64: channels 8(v % 2) .. + 7 of block v / 2, 4 inputs each (its
      // high bits: high_bits_at); its sub-scales (6-bit): bytes 16(v % 2) .. + 15 of the block's 32, (c_lo,
      // c_hi) for each channel.
      const uint8_t* cv[VW];
      const uint8_t* hv[VW];
      const uint8_t* sub[VW];
      const uint16_t* sv[VW];
#pragma GCC unroll 4
      for (int j = 0; j < VW; ++j) {
        const int v = v0 + j;
        cv[j] = codes + (v / 2) * cstride + (v % 2) * 32;
        hv[j] = codes + (v / 2) * cstride + high_bits_at<BITS>(v % 2);
        sub[j] = codes + (v / 2) * cstride + kSub + (v % 2) * 16;
        sv[j] = scales + (v / 2) * KB * S * BN + (v % 2) * 8;
      }
      __m256 y[MR][VW];
#pragma GCC unroll 4
      for (int j = 0; j < VW; ++j) {
        const int64_t col = n0 + (v0 + j) * 8;
        const __m256i mask = resume && col < N ? tail_mask8(N - col) : _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) y[i][j] = _mm256_maskload_ps(out + i * ldo + col, mask);
      }
      for (int64_t b = 0; b < blocks; ++b) {
        const int8_t* xb = xq + b * QK;
        auto four = [&](int i, int k) {  // activations k .. k + 3 of row i, in every lane
          int32_t a;
          std::memcpy(&a, xb + i * K + k, sizeof(a));
          return _mm256_set1_epi32(a);
        };
#pragma GCC unroll 4
        for (int j = 0; j < VW; j += 2)
#pragma GCC unroll 8
          for (int64_t line = 0; line < CB; line += 64)
            _mm_prefetch(reinterpret_cast<const char*>(cv[j] + (b + kAhead) * CB + line), _MM_HINT_T0);
        __m256i dot[MR][VW];
        // Codes as signed bytes (the 8-bit path, below): dot starts at 128 sum a, then adds sum (u - 128) a of
        // each group of 4 inputs from k, codes u in vector j.
        auto start_signed_sums = [&] {
#pragma GCC unroll 8
          for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
            for (int j = 0; j < VW; ++j) dot[i][j] = _mm256_slli_epi32(_mm256_set1_epi32(xsum[i * KB + b]), 7);
        };
        auto add_signed_products = [&](int j, __m256i u, int k) {
          const __m256i w = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80))), wa = _mm256_abs_epi8(w);
#pragma GCC unroll 8
          for (int i = 0; i < MR; ++i)
            dot[i][j] = _mm256_add_epi32(
                dot[i][j], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, _mm256_sign_epi8(four(i, k), w)), ones));
        };
        if constexpr (BITS == 6) {
          // vpmaddubsw of codes u <= 63 by an int8 a: a pair is at most 2 * 63 * 127 = 16002 < 32767; then
          // vpmaddwd by the channel's sub-scale in both int16 halves of its lane adds c (p0 + p1) into
          // int32, so dot = sum c u a over both halves (|dot| < 2^26), and the zero's share, zero (c_lo
          // sum_lo + c_hi sum_hi), leaves it after the block.
          __m256i pairs[VW], c_lo[VW], c_hi[VW];  // (c_lo, c_hi) of each channel; c_lo twice; c_hi twice
#pragma GCC unroll 4
          for (int j = 0; j < VW; ++j) {
            pairs[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub[j] + b * CB)));
            c_lo[j] = _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(pairs[j], 0xA0), 0xA0);  // words 0, 0, 2, 2
            c_hi[j] = _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(pairs[j], 0xF5), 0xF5);  // words 1, 1, 3, 3
          }
#pragma GCC unroll 8
          for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
            for (int j = 0; j < VW; ++j) dot[i][j] = _mm256_setzero_si256();
          // Two lines at a time, the two whose high pairs share one vector: per half, two groups' pairs add
          // up in int16 (2 * 16002 < 32767) before the one vpmaddwd by the sub-scale.
#pragma GCC unroll 1
          for (int p = 0; p < 2; ++p) {
#pragma GCC unroll 8
            for (int i = 0; i < MR; ++i) {
              const __m256i a_lo0 = four(i, 8 * p), a_lo1 = four(i, 8 * p + 4);
              const __m256i a_hi0 = four(i, 16 + 8 * p), a_hi1 = four(i, 20 + 8 * p);
#pragma GCC unroll 4
              for (int j = 0; j < VW; ++j) {
                const uint8_t* line = cv[j] + b * CB + 2 * p * 64;
                __m256i lo0, hi0, lo1, hi1;  // groups 2p, 4 + 2p, 2p + 1 and 5 + 2p
                if constexpr (WIDE) {
                  lo0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
                  lo1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 64));
                  hi0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 256));
                  hi1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 320));
                } else {  // the two lines share their pair vector's load
                  unpack_half<6>(cv[j] + b * CB, hv[j] + b * CB, 2 * p, lo0, hi0);
                  unpack_half<6>(cv[j] + b * CB, hv[j] + b * CB, 2 * p + 1, lo1, hi1);
                }
                const __m256i s_lo = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, a_lo0), _mm256_maddubs_epi16(lo1, a_lo1));
                const __m256i s_hi = _mm256_add_epi16(_mm256_maddubs_epi16(hi0, a_hi0), _mm256_maddubs_epi16(hi1, a_hi1));
                dot[i][j] = _mm256_add_epi32(dot[i][j], _mm256_add_epi32(_mm256_madd_epi16(s_lo, c_lo[j]),
                                                                         _mm256_madd_epi16(s_hi, c_hi[j])));
              }
            }
          }
#pragma GCC unroll 8
          for (int i = 0; i < MR; ++i) {
            // (sum_lo, sum_hi) as int16 (|sum| <= 16 * 127) beside each channel's (c_lo, c_hi).
            const int32_t lo = xlo[i * KB + b], hi = xsum[i * KB + b] - lo;
            const __m256i sums = _mm256_set1_epi32(static_cast<int32_t>((static_cast<uint32_t>(hi) << 16) |
                                                                        (static_cast<uint32_t>(lo) & 0xFFFFu)));
#pragma GCC unroll 4
            for (int j = 0; j < VW; ++j) {
              dot[i][j] = _mm256_sub_epi32(dot[i][j], _mm256_mullo_epi32(_mm256_madd_epi16(pairs[j], sums),
                                                                          _mm256_set1_epi32(zero)));
            }
          }
        } else if (BITS == kTableCodes && !WIDE && wide_table<VW>(hv, b * CB)) {
          // Table codes past 31 (IQ4's, up to 255): the 8-bit codes' signed products (below), on the codes the
          // tables give.
          start_signed_sums();
#pragma GCC unroll 1
          for (int l = 0; l < 4; ++l) {
#pragma GCC unroll 4
            for (int j = 0; j < VW; ++j) {
              __m256i lo, hi;  // groups l and 4 + l, as codes
              unpack_half<BITS>(cv[j] + b * CB, hv[j] + b * CB, l, lo, hi);
              add_signed_products(j, lo, 4 * l);
              add_signed_products(j, hi, 16 + 4 * l);
            }
          }
        } else if constexpr (BITS != 8) {
          // vpmaddubsw of codes u <= 15 by an int8 a (|a| <= 127 by construction): a pair is at most
          // 2 * 15 * 127 = 3810, and the 8 pairs of a lane over the 32-block (4 groups, low and high
          // nibbles) at most 30480 < 32767, so the block adds up in int16 without overflowing; one vpmaddwd
          // by ones then widens it. 5-bit codes (u <= 31: 7874 a pair) widen every two groups (31496).
          constexpr int kWiden = BITS == 4 ? 4 : 2;
          __m256i sum16[MR][VW];
          // Not unrolled: unrolled, GCC reorders the int16 additions and spills the products it gathers.
#pragma GCC unroll 1
          for (int l = 0; l < 4; ++l) {
#pragma GCC unroll 8
            for (int i = 0; i < MR; ++i) {
              const __m256i a_lo = four(i, 4 * l), a_hi = four(i, 16 + 4 * l);
#pragma GCC unroll 4
              for (int j = 0; j < VW; ++j) {
                __m256i lo, hi;  // groups l (inputs 4l .. 4l + 3) and 4 + l (inputs 16 + 4l ..)
                if constexpr (WIDE) {
                  lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cv[j] + b * CB + l * 64));
                  hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cv[j] + b * CB + (4 + l) * 64));
                } else {
                  unpack_half<BITS>(cv[j] + b * CB, hv[j] + b * CB, l, lo, hi);
                }
                const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, a_lo), _mm256_maddubs_epi16(hi, a_hi));
                sum16[i][j] = l % kWiden == 0 ? p : _mm256_add_epi16(sum16[i][j], p);
                if (l % kWiden == kWiden - 1) {
                  const __m256i wide = _mm256_madd_epi16(sum16[i][j], ones);
                  dot[i][j] = l < kWiden ? wide : _mm256_add_epi32(dot[i][j], wide);
                }
              }
            }
          }
        } else {
          // 8-bit codes u = w + 128, w = u ^ 0x80 signed: vpmaddubsw takes |w| <= 128 and a with w's
          // sign (vpsignb), |a| <= 127 (|x / s| <= 127 by construction; a NaN's code is 0), so a pair is
          // at most 2 * 128 * 127 = 32512 < 32767; vpmaddwd by ones adds a channel's 4 inputs into its
          // int32 lane. dot = sum w a + 128 sum a.
          start_signed_sums();
#pragma GCC unroll 1
          for (int g = 0; g < 8; ++g) {
#pragma GCC unroll 4
            for (int j = 0; j < VW; ++j) {
              const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cv[j] + b * CB + g * 64));
              add_signed_products(j, u, 4 * g);
            }
          }
        }
#pragma GCC unroll 4
        for (int j = 0; j < VW; ++j) {
          const uint16_t* sc = sv[j] + b * S * BN;
          const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
          const __m256 m = S == 2 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + BN)))
                                  : _mm256_setzero_ps();
#pragma GCC unroll 8
          for (int i = 0; i < MR; ++i) {
            // The exact integer sum the reference scales (as the VNNI tiles): 6-bit dot is final already.
            const __m256i q = BITS == 6 || S == 2 ? dot[i][j]
                                                  : _mm256_sub_epi32(dot[i][j], _mm256_set1_epi32(zero * xsum[i * KB + b]));
            const __m256 t = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(xs[i * KB + b])), d);
            if (S == 2) {  // w = d u + m: (y + t) + m c
              y[i][j] = _mm256_add_ps(_mm256_add_ps(y[i][j], t), _mm256_mul_ps(m, _mm256_set1_ps(xc[i * KB + b])));
            } else {
              y[i][j] = _mm256_add_ps(y[i][j], t);
            }
          }
        }
      }
#pragma GCC unroll 4
      for (int j = 0; j < VW; ++j) {
        const int64_t col = n0 + (v0 + j) * 8;
        if (col >= N) break;
        const bool full = N - col >= 8;
        const __m256i mask = tail_mask8(N - col);
        const __m256 bv = !bias ? _mm256_setzero_ps()
                          : full ? _mm256_loadu_ps(bias + col) : _mm256_maskload_ps(bias + col, mask);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          const __m256 r = bias ? _mm256_add_ps(y[i][j], bv) : y[i][j];
          if (full) {
            _mm256_storeu_ps(out + i * ldo + col, r);
          } else {
            _mm256_maskstore_ps(out + i * ldo + col, mask, r);
          }
        }
      }
    }
  }
};
#endif

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// The same sums as the tiles, one output at a time, in the reference's order.
void portable_block(const int8_t* xq, int64_t K, const float* xs, const float* xc, const int32_t* xsum,
                    const int32_t* xlo, int64_t KB, const uint8_t* codes, const uint16_t* scales, int S, int32_t zero,
                    int bits, const float* bias, float* out, int64_t ldo, int64_t n0, int64_t N, int64_t M) {
  const int64_t CB = w4a8_code_bytes(bits);
  for (int c = 0; c < BN && n0 + c < N; ++c) {
    for (int64_t i = 0; i < M; ++i) {
      float y = 0.f;
      for (int64_t b = 0; b < KB; ++b) {
        int32_t dot[2] = {0, 0};  // sum u a over inputs 0-15 and 16-31
        for (int k = 0; k < QK; ++k) {
          int32_t u;
          if (bits != 8) {  // input k of the block: group (k % 16) / 4, low nibble below 16, high from 16
            const int t = c * 4 + k % 4;  // its byte in the group's 64
            const uint8_t byte = codes[b * CB + ((k % 16) / 4) * 64 + t];
            u = k < 16 ? (byte & 0x0F) : (byte >> 4);
            if (bits == kTableCodes) u = codes[b * CB + kHighBits + u];
            const int g = (k % 16) / 4 + (k < 16 ? 0 : 4);  // its mask in each plane, bit t
            if (bits == 5) u |= ((codes[b * CB + kHighBits + g * 8 + t / 8] >> (t % 8)) & 1) << 4;
            if (bits == 6) {  // line l = g % 4's pair vector l / 2, bits 2 (2 (l % 2) + half)
              const int l = g % 4, at = 2 * (2 * (l % 2) + g / 4);
              u |= ((codes[b * CB + kHighBits + (l / 2) * 64 + t] >> at) & 3) << 4;
            }
          } else {
            u = codes[b * CB + (k / 4) * 64 + c * 4 + k % 4];
          }
          dot[k / 16] += u * static_cast<int32_t>(xq[i * K + b * QK + k]);
        }
        // The exact integer sum the reference scales, as the tiles take it.
        int32_t q;
        if (bits == 6) {
          const int8_t* sub = reinterpret_cast<const int8_t*>(codes + b * CB + kSubScales + c * 2);
          const int32_t lo = xlo[i * KB + b], hi = xsum[i * KB + b] - lo;
          q = sub[0] * (dot[0] - zero * lo) + sub[1] * (dot[1] - zero * hi);
        } else {
          q = S == 2 ? dot[0] + dot[1] : dot[0] + dot[1] - zero * xsum[i * KB + b];
        }
        const float d = half_to_float(scales[b * S * BN + c]);
        const float t = (static_cast<float>(q) * xs[i * KB + b]) * d;
        if (S == 2) {
          const float m = half_to_float(scales[b * S * BN + BN + c]);
          y = (y + t) + m * xc[i * KB + b];
        } else {
          y = y + t;
        }
      }
      out[i * ldo + n0 + c] = bias ? y + bias[n0 + c] : y;
    }
  }
}

#if defined(LADDER_VNNI) || defined(LADDER_AVX2_INT8)
// From how many rows 4-, 5- and 6-bit codes run on widened codes (widen_block: each row group then reads
// bytes instead of unpacking every block again). Measured on [8192, 2048] weights against the tiles' own
// unpacking, 2 threads (benchmarks/RESULTS.md, "Stop 44"): with VNNI 5- and 6-bit codes 10-20% faster from 32
// rows and 4-bit codes (cheaper to unpack) 2-10% from 128, each slower below; on AVX2, where the 5-bit masks
// and 6-bit pairs cost more beside vpmaddubsw, 5-bit codes 4% faster at 8 rows and 22-30% from 16 and 6-bit
// codes 7-17% from 16, while 4-bit codes gained at most 5% on [8192, 2048] and lost 5% on [16384, 2048] at
// 512 rows (the loads of twice the bytes cost what the two masks a line saved): never widened there.
// Table codes unpack as 4-bit ones do, one shuffle more: widened from the same rows.
#ifdef LADDER_VNNI
constexpr int64_t kWideFrom[4] = {128, 32, 32, 128};
#else
constexpr int64_t kWideFrom[4] = {INT64_MAX, 8, 16, INT64_MAX};
#endif

bool widened(int bits, int64_t M) { return bits != 8 && M >= kWideFrom[bits == kTableCodes ? 3 : bits - 4]; }

// The blocks' codes a thread widens at a time below 128 rows, L1-sized so that its row groups read them from
// L1; from 128 rows a group's whole KB (in L2 with VNNI's groups of 3 blocks) measured 5-10% faster.
constexpr int64_t kWideChunkBytes = 24576;

template <int BITS, class Call>
void for_each_wide_tile(int64_t M, int64_t NBLK, int64_t KB, const uint8_t* codes, int64_t work_per_block,
                        int64_t min_work, const Call& call) {
  using Tiles = W4A8Tiles<BITS, true>;
  constexpr int64_t CB = w4a8_code_bytes(BITS), WB = wide_bytes(BITS);
  const int group = Tiles::kMaxNb[std::min<int64_t>(M, Tiles::kMaxMr)];
  const int64_t chunk = M >= 128 ? KB : std::max<int64_t>(4, kWideChunkBytes / (group * WB));
  const int64_t grain = std::max<int64_t>(1, (min_work + work_per_block - 1) / std::max<int64_t>(work_per_block, 1));
  parallel_for(0, NBLK, grain, [&](int64_t b0, int64_t b1) {
    // A thread's own buffer, kept between calls (no task here starts another on its thread).
    thread_local std::vector<uint8_t> buffer;
    buffer.resize(static_cast<size_t>(group * chunk * WB + 64));
    uint8_t* wide = buffer.data() + (-reinterpret_cast<uintptr_t>(buffer.data()) & 63);  // 64-byte aligned
    for (int64_t b = b0; b < b1; b += group) {
      const int nb = static_cast<int>(std::min<int64_t>(group, b1 - b));
      for (int64_t c0 = 0; c0 < KB; c0 += chunk) {
        const int64_t kc = std::min<int64_t>(chunk, KB - c0);
        for (int j = 0; j < nb; ++j)
          for (int64_t t = 0; t < kc; ++t)
            widen_block<BITS>(codes + ((b + j) * KB + c0 + t) * CB, wide + (j * kc + t) * WB);
        for (int64_t m = 0; m < M; m += Tiles::kMaxMr) {
          const int mr = static_cast<int>(std::min<int64_t>(Tiles::kMaxMr, M - m));
          call(pick<Tiles>(mr, nb), m, b, c0, kc, wide);
        }
      }
    }
  });
}
#endif

}  // namespace

void w4a8_rows(const float* xp, int64_t M, const W4A8Weight& w, float* op, W4A8Scratch& scratch, bool portable) {
  const int64_t K = w.K, KB = w.K / QK, N = w.N, NBLK = w.NBLK, CB = w4a8_code_bytes(w.bits);
  if (M == 0 || N == 0) return;
#if !defined(LADDER_VNNI) && !defined(LADDER_AVX2_INT8)
  portable = true;
#endif
  scratch.xq.resize(M * K);
  scratch.xs.resize(M * KB);
  scratch.xc.resize(M * KB);
  scratch.xsum.resize(M * KB);
  scratch.xlo.resize(M * KB);
  int8_t* xq = scratch.xq.data();
  float* xs = scratch.xs.data();
  float* xc = scratch.xc.data();
  int32_t* xsum = scratch.xsum.data();
  int32_t* xlo = scratch.xlo.data();
  auto quantize = quantize_row_portable;
#if defined(LADDER_VNNI) || defined(LADDER_AVX2_INT8)
  if (!portable) quantize = quantize_row;
#endif
  if (M == 1) {  // a decode row: no task for so little work
    quantize(xp, KB, xq, xs, xc, xsum, xlo);
  } else {
    parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) {
        quantize(xp + m * K, KB, xq + m * K, xs + m * KB, xc + m * KB, xsum + m * KB, xlo + m * KB);
      }
    });
  }
#ifdef LADDER_VNNI
  if (!portable && w.bits == 6) {
    // The 6-bit tiles' offsets, ready to add to each half's integer sum: kMagic - zero * sum (its float
    // conversion below), in place of the first half's sum (xlo) and the whole block's (xsum).
    for (int64_t t = 0; t < M * KB; ++t) {
      const int32_t lo = xlo[t], hi = xsum[t] - lo;
      xlo[t] = kMagic - w.zero * lo;
      xsum[t] = kMagic - w.zero * hi;
    }
  }
#endif
  const uint8_t* cp = w.codes;
  const uint16_t* sp = w.scales;
  const int S = w.S;
  const int32_t z = w.zero;
  const float* bp = w.bias;
  const int64_t work_per_block = M * K * BN, min_work = 262144;
  if (portable) {
    const int64_t grain = std::max<int64_t>(1, (min_work + work_per_block - 1) / std::max<int64_t>(work_per_block, 1));
    parallel_for(0, NBLK, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        portable_block(xq, K, xs, xc, xsum, xlo, KB, cp + b * KB * CB, sp + b * KB * S * BN, S, z, w.bits, bp, op,
                       N, b * BN, N, M);
    });
    return;
  }
#if defined(LADDER_VNNI) || defined(LADDER_AVX2_INT8)
  auto call = [&](auto tile, int64_t m, int64_t b) {  // all KB blocks of the packed codes, from zero
    tile(xq + m * K, K, xs + m * KB, xc + m * KB, xsum + m * KB, xlo + m * KB, KB, cp + b * KB * CB,
         sp + b * KB * S * BN, S, z, bp, op + m * N, N, b * BN, N, KB, KB * CB, false);
  };
  if (widened(w.bits, M)) {
    // Rows m.. of blocks b.. over the chunk of kc 32-blocks from c0, its codes widened at `wide`.
    auto call_wide = [&](auto tile, int64_t m, int64_t b, int64_t c0, int64_t kc, const uint8_t* wide) {
      const int64_t r = m * KB + c0;
      tile(xq + m * K + c0 * QK, K, xs + r, xc + r, xsum + r, xlo + r, KB, wide, sp + (b * KB + c0) * S * BN, S, z,
           c0 + kc == KB ? bp : nullptr, op + m * N, N, b * BN, N, kc, kc * wide_bytes(w.bits), c0 > 0);
    };
    if (w.bits == 4) {
      for_each_wide_tile<4>(M, NBLK, KB, cp, work_per_block, min_work, call_wide);
    } else if (w.bits == kTableCodes) {
      for_each_wide_tile<kTableCodes>(M, NBLK, KB, cp, work_per_block, min_work, call_wide);
    } else if (w.bits == 5) {
      for_each_wide_tile<5>(M, NBLK, KB, cp, work_per_block, min_work, call_wide);
    } else {
      for_each_wide_tile<6>(M, NBLK, KB, cp, work_per_block, min_work, call_wide);
    }
    return;
  }
  if (w.bits == 4) {
    for_each_tile<W4A8Tiles<4>>(M, NBLK, work_per_block, min_work, call);
  } else if (w.bits == kTableCodes) {
    for_each_tile<W4A8Tiles<kTableCodes>>(M, NBLK, work_per_block, min_work, call);
  } else if (w.bits == 5) {
    for_each_tile<W4A8Tiles<5>>(M, NBLK, work_per_block, min_work, call);
  } else if (w.bits == 6) {
    for_each_tile<W4A8Tiles<6>>(M, NBLK, work_per_block, min_work, call);
  } else {
    for_each_tile<W4A8Tiles<8>>(M, NBLK, work_per_block, min_work, call);
  }
#endif
}

namespace {

// ladder::w4a8_linear: x [..., K] (computed in float32); codes [NBLK, KB, CB] uint8 (CB 256, 320, 416 or 512
// for 4-, 5-, 6- or 8-bit codes, 272 for table codes); scales [NBLK, KB, S, 16] float16 (S 2: d then m; S 1: d,
// m = -zero * d); bias [N] or none.
// Returns [..., N] float32. portable: the portable loop even where the VNNI or AVX2 tiles exist (tests).
at::Tensor w4a8_linear(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias_in, int64_t N, int64_t zero, bool portable) {
  TORCH_CHECK(x_in.device().is_cpu() && codes.device().is_cpu() && scales.device().is_cpu(),
              "w4a8_linear: CPU tensors only");
  const at::Tensor x = float_rows(x_in);
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
              w4a8_code_bits(codes.size(2)) != 0, "codes: [NBLK, KB, 256, 272, 320, 416 or 512] uint8");
  TORCH_CHECK(scales.dim() == 4 && scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
              scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) && scales.size(3) == BN &&
              (scales.size(2) == 1 || scales.size(2) == 2), "scales: [NBLK, KB, 1 or 2, 16] float16");
  const int64_t M = x.size(0), K = x.size(1), NBLK = codes.size(0), KB = codes.size(1);
  TORCH_CHECK(K == KB * QK, "the weight holds ", KB * QK, " input channels, x has ", K);
  check_blocks(N, NBLK);
  const auto bias = float_vector(bias_in);
  const W4A8Weight w{codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                     optional_vector_data(bias, N, "bias"), N, K, NBLK, static_cast<int>(scales.size(2)),
                     w4a8_code_bits(codes.size(2)), static_cast<int32_t>(zero)};
  auto out = at::empty({M, N}, x.options());
  W4A8Scratch scratch;
  w4a8_rows(x.data_ptr<float>(), M, w, out.data_ptr<float>(), scratch, portable);
  return out.view(sizes_with_last(x_in, N));
}

}  // namespace

bool has_vnni() {
#ifdef LADDER_VNNI
  return true;
#else
  return false;
#endif
}

bool has_int8_tiles() {
#if defined(LADDER_VNNI) || defined(LADDER_AVX2_INT8)
  return true;
#else
  return false;
#endif
}

}  // namespace ladder

TORCH_LIBRARY_IMPL(ladder, CPU, m) { m.impl("w4a8_linear", &ladder::w4a8_linear); }

// Whether this build has the AVX-512 VNNI tiles, or any vector int8 tiles (VNNI or AVX2), compiled for
// this CPU's features.
TORCH_LIBRARY_FRAGMENT(ladder_cpu, m) {
  m.def("has_vnni() -> bool", &ladder::has_vnni);
  m.def("has_int8_tiles() -> bool", &ladder::has_int8_tiles);
}
