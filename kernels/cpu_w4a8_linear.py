"""W4A8 linear for the CPU over a GGUF's own quantized blocks: 4-bit (Q4_0, Q4_1) or 8-bit (Q8_0) weight
codes times int8 activations quantized per 32-block on the fly.

The weight of output n over input block b (32 input channels) is w = d[n, b] * u + m[n, b], with u an
unsigned code (0..15, or 0..255) and d, m float16, which is exactly how the file stores it: Q4_1 keeps
d and m; Q4_0 is m = -8 d; Q8_0 (signed q) is u = q + 128, m = -128 d. The weights carry no error beyond
the file's own. Each 32-block of an input row is quantized symmetrically, as llama.cpp's Q8_1 does:
s = max(max|x_block|, 1e-12) / 127, a = round(x / s) (half to even). Then

    y[n] = sum over b, in order, of   (float(dot[n, b]) * s[b]) * d[n, b]  +  m[n, b] * (s[b] * sum(a_b))

with dot = sum_k u * a exact in int32, each product and sum rounded to float32 as written, left to right:
`(y + t) + r`. Where m is implied (m = -zero * d), the offset is taken out of the integer sum instead,
exactly: y[n] = sum over b of (float(sum_k (u - zero) * a) * s[b]) * d[n, b], one product fewer. The
torch reference (`w4a8_matmul_ref`) does the same operations in the same order, so the C++ kernel equals
it bit for bit for every shape, batch and thread count, and a row's result never
depends on the rows beside it.

The product runs on AVX-512 VNNI: `vpdpbusd` multiplies 64 unsigned bytes (the codes) by 64 signed
bytes (four activations broadcast to 16 lanes) into 16 int32 sums, so unsigned codes need no offset.
Codes are packed once (`pack`) per 16 output channels and 32-block: 8-bit as [8 groups, 16, 4] bytes,
4-bit as [4, 16, 4] bytes whose low nibbles hold groups 0-3 and high nibbles groups 4-7 (a 64-byte
load and two masks feed two instructions). A 4-bit weight moves 5/8 of the bytes of an int8 one
(Q4_1: 20 bytes per 32 weights), which is what bounds a batch-1 decode step. d and m stay float16,
[16] each per block, converted in registers. Threads split the blocks of output channels. A portable
loop over the same layout is compiled where AVX-512 VNNI is missing (and can be asked for, for tests).
Built on first use like every CPU kernel (kernels/cpu_extension.py); without it (or with
LADDER_CPU_KERNELS=0) `w4a8_linear` runs the torch reference.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import LazyExtension, cpu_kernels_enabled

BLOCK_N = 16  # output channels per packed block
BLOCK_K = 32  # input channels per quantization block (the GGUF's and the activations')
GROUP_K = 4  # input channels summed by one vpdpbusd lane

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
// Bit-equal to the torch reference: no multiply-add contraction anywhere.
#pragma GCC optimize("fp-contract=off")
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define LADDER_VNNI 1
#include <immintrin.h>
#endif

constexpr int BN = 16;  // output channels per block
constexpr int QK = 32;  // input channels per quantization block
constexpr int MAX_MR = 4;

// One row x [KB * 32] -> int8 xq, and per block its scale xs[b] and xs[b] * sum(xq of the block) xc[b].
static void quantize_row_portable(const float* x, int64_t KB, int8_t* xq, float* xs, float* xc, int32_t* xsum) {
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
    }
    xs[b] = s;
    xc[b] = s * static_cast<float>(sum);
    xsum[b] = sum;
  }
}

#ifdef LADDER_VNNI
static void quantize_row(const float* x, int64_t KB, int8_t* xq, float* xs, float* xc, int32_t* xsum) {
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
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    xs[b] = s;
    xc[b] = s * static_cast<float>(sum);
    xsum[b] = sum;
  }
}

// MR rows times NB consecutive blocks of 16 output channels, over all KB blocks of 32 input channels.
// codes: the first block's codes, each block KB * CB bytes; scales: its float16 d (and m), KB * S * 16 each.
template <bool FOUR, int MR, int NB>
static void tile(const int8_t* __restrict xq, int64_t K, const float* __restrict xs, const float* __restrict xc,
                 const int32_t* __restrict xsum, int64_t KB, const uint8_t* __restrict codes,
                 const uint16_t* __restrict scales, int S, int32_t zero,
                 const float* __restrict bias, float* __restrict out, int64_t ldo, int64_t n0, int64_t N) {
  constexpr int64_t CB = FOUR ? 256 : 512;
  __m512 y[MR][NB];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) y[i][j] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < KB; ++b) {
    __m512i acc[MR][NB];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_si512();
    const int8_t* xb = xq + b * QK;
    if constexpr (FOUR) {
#pragma GCC unroll 4
      for (int l = 0; l < 4; ++l) {
#pragma GCC unroll 8
        for (int j = 0; j < NB; ++j) {
          const __m512i raw = _mm512_loadu_si512(codes + j * KB * CB + b * CB + l * 64);
          const __m512i wlo = _mm512_and_si512(raw, nibble);  // groups 0-3: inputs 4l .. 4l + 3
          const __m512i whi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);  // inputs 16 + 4l ..
#pragma GCC unroll 8
          for (int i = 0; i < MR; ++i) {
            int32_t a0, a1;
            std::memcpy(&a0, xb + i * K + 4 * l, 4);
            std::memcpy(&a1, xb + i * K + 16 + 4 * l, 4);
            acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], wlo, _mm512_set1_epi32(a0));
            acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], whi, _mm512_set1_epi32(a1));
          }
        }
      }
    } else {
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
#pragma GCC unroll 8
        for (int j = 0; j < NB; ++j) {
          const __m512i w = _mm512_loadu_si512(codes + j * KB * CB + b * CB + g * 64);
#pragma GCC unroll 8
          for (int i = 0; i < MR; ++i) {
            int32_t a;
            std::memcpy(&a, xb + i * K + 4 * g, 4);
            acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], w, _mm512_set1_epi32(a));
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      const uint16_t* sc = scales + (j * KB + b) * S * BN;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
      if (S == 2) {  // w = d u + m
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + BN)));
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          const __m512 ds = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[i][j]), _mm512_set1_ps(xs[i * KB + b]));
          const __m512 t = _mm512_mul_ps(ds, d);
          const __m512 r = _mm512_mul_ps(m, _mm512_set1_ps(xc[i * KB + b]));
          y[i][j] = _mm512_add_ps(_mm512_add_ps(y[i][j], t), r);
        }
      } else {  // w = d (u - zero): the offset leaves the integer sum exactly, sum (u - zero) a
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          const __m512i q = _mm512_sub_epi32(acc[i][j], _mm512_set1_epi32(zero * xsum[i * KB + b]));
          const __m512 t = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(xs[i * KB + b])), d);
          y[i][j] = _mm512_add_ps(y[i][j], t);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NB; ++j) {
    const int64_t col = n0 + j * BN;
    if (col >= N) break;
    const __mmask16 mask = N - col >= BN ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - col)) - 1u);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      __m512 v = y[i][j];
      if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + col));
      _mm512_mask_storeu_ps(out + i * ldo + col, mask, v);
    }
  }
}

// The widest group of blocks whose accumulators (2 * MR * NB) fit the 32 vector registers.
static inline int max_nb(int mr) {
  static const int table[MAX_MR + 1] = {0, 6, 4, 3, 3};
  return table[mr];
}

using TileFn = void (*)(const int8_t*, int64_t, const float*, const float*, const int32_t*, int64_t, const uint8_t*,
                        const uint16_t*, int, int32_t, const float*, float*, int64_t, int64_t, int64_t);

template <bool FOUR, int MR>
static TileFn pick_nb(int nb) {
  switch (nb) {
    case 1: return tile<FOUR, MR, 1>;
    case 2: if constexpr (MR <= 6) return tile<FOUR, MR, 2>; break;
    case 3: if constexpr (MR <= 4) return tile<FOUR, MR, 3>; break;
    case 4: if constexpr (MR <= 2) return tile<FOUR, MR, 4>; break;
    case 5: if constexpr (MR <= 1) return tile<FOUR, MR, 5>; break;
    case 6: if constexpr (MR <= 1) return tile<FOUR, MR, 6>; break;
  }
  TORCH_CHECK(false, "no ", MR, "x", nb, " tile");
}

template <bool FOUR>
static TileFn pick(int mr, int nb) {
  switch (mr) {
    case 1: return pick_nb<FOUR, 1>(nb);
    case 2: return pick_nb<FOUR, 2>(nb);
    case 3: return pick_nb<FOUR, 3>(nb);
    case 4: return pick_nb<FOUR, 4>(nb);
  }
  TORCH_CHECK(false, "no ", mr, "-row tile");
}
#endif

static inline float half_to_float(uint16_t h) {
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// The same sums as `tile`, one output at a time, in the reference's order.
static void portable_block(const int8_t* xq, int64_t K, const float* xs, const float* xc, const int32_t* xsum,
                           int64_t KB, const uint8_t* codes, const uint16_t* scales, int S, int32_t zero, bool four,
                           const float* bias, float* out, int64_t ldo, int64_t n0, int64_t N, int64_t M) {
  const int64_t CB = four ? 256 : 512;
  for (int c = 0; c < BN && n0 + c < N; ++c) {
    for (int64_t i = 0; i < M; ++i) {
      float y = 0.f;
      for (int64_t b = 0; b < KB; ++b) {
        int32_t dot = 0;
        for (int k = 0; k < QK; ++k) {
          int32_t u;
          if (four) {  // input k of the block: group (k % 16) / 4, low nibble below 16, high from 16
            const uint8_t byte = codes[b * CB + ((k % 16) / 4) * 64 + c * 4 + k % 4];
            u = k < 16 ? (byte & 0x0F) : (byte >> 4);
          } else {
            u = codes[b * CB + (k / 4) * 64 + c * 4 + k % 4];
          }
          dot += u * static_cast<int32_t>(xq[i * K + b * QK + k]);
        }
        const float d = half_to_float(scales[b * S * BN + c]);
        if (S == 2) {
          const float m = half_to_float(scales[b * S * BN + BN + c]);
          const float t = (static_cast<float>(dot) * xs[i * KB + b]) * d;
          const float r = m * xc[i * KB + b];
          y = (y + t) + r;
        } else {
          y = y + (static_cast<float>(dot - zero * xsum[i * KB + b]) * xs[i * KB + b]) * d;
        }
      }
      out[i * ldo + n0 + c] = bias ? y + bias[n0 + c] : y;
    }
  }
}

// x [..., K] float32 contiguous; codes [NBLK, KB, CB] uint8 (CB 256 for 4-bit, 512 for 8-bit); scales
// [NBLK, KB, S, 16] float16 (S 2: d then m; S 1: d, m = -zero * d); bias [N] float32 or none.
// Returns [..., N] float32.
torch::Tensor w4a8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, c10::optional<torch::Tensor> bias,
                          int64_t N, int64_t zero, bool portable) {
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu() && scales.device().is_cpu(),
              "w4a8_linear: CPU tensors only");
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: [..., K] float32 contiguous");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == torch::kByte && codes.is_contiguous() &&
              (codes.size(2) == 256 || codes.size(2) == 512), "codes: [NBLK, KB, 256 or 512] uint8");
  TORCH_CHECK(scales.dim() == 4 && scales.scalar_type() == torch::kHalf && scales.is_contiguous() &&
              scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) && scales.size(3) == BN &&
              (scales.size(2) == 1 || scales.size(2) == 2), "scales: [NBLK, KB, 1 or 2, 16] float16");
  const int64_t K = x.size(-1), NBLK = codes.size(0), KB = codes.size(1);
  const bool four = codes.size(2) == 256;
  const int S = static_cast<int>(scales.size(2));
  TORCH_CHECK(K == KB * QK, "the weight holds ", KB * QK, " input channels, x has ", K);
  TORCH_CHECK(N > (NBLK - 1) * BN && N <= NBLK * BN, "n ", N, " does not match ", NBLK, " packed blocks");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == torch::kFloat && bias->is_contiguous() &&
                bias->numel() == N, "bias: [N] float32");
    bp = bias->data_ptr<float>();
  }
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto out = torch::empty(sizes, x.options());
  const int64_t M = x.numel() / std::max<int64_t>(K, 1);
  if (M == 0 || N == 0) return out;
#ifndef LADDER_VNNI
  portable = true;
#endif
  std::vector<int8_t> xq(M * K);
  std::vector<float> xs(M * KB), xc(M * KB);
  std::vector<int32_t> xsum(M * KB);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
#ifdef LADDER_VNNI
      if (!portable) {
        quantize_row(xp + m * K, KB, xq.data() + m * K, xs.data() + m * KB, xc.data() + m * KB, xsum.data() + m * KB);
        continue;
      }
#endif
      quantize_row_portable(xp + m * K, KB, xq.data() + m * K, xs.data() + m * KB, xc.data() + m * KB,
                            xsum.data() + m * KB);
    }
  });
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  float* op = out.data_ptr<float>();
  const int64_t CB = codes.size(2);
  const int32_t z = static_cast<int32_t>(zero);
  // Each thread gets at least ~256K multiply-adds (about a microsecond): tiny problems stay on one thread.
  const int64_t per_block = std::max<int64_t>(1, M * K * BN);
  const int64_t grain = std::max<int64_t>(1, ((int64_t)262144 + per_block - 1) / per_block);
  at::parallel_for(0, NBLK, grain, [&](int64_t b0, int64_t b1) {
    if (portable) {
      for (int64_t b = b0; b < b1; ++b)
        portable_block(xq.data(), K, xs.data(), xc.data(), xsum.data(), KB, cp + b * KB * CB, sp + b * KB * S * BN,
                       S, z, four, bp, op, N, b * BN, N, M);
      return;
    }
#ifdef LADDER_VNNI
    const int group = max_nb(static_cast<int>(std::min<int64_t>(M, MAX_MR)));
    for (int64_t b = b0; b < b1; b += group) {
      const int nb = static_cast<int>(std::min<int64_t>(group, b1 - b));
      for (int64_t m = 0; m < M; m += MAX_MR) {
        const int mr = static_cast<int>(std::min<int64_t>(MAX_MR, M - m));
        // max_nb(mr) >= nb for every mr <= min(M, MAX_MR), so one call covers all nb blocks.
        const TileFn fn = four ? pick<true>(mr, nb) : pick<false>(mr, nb);
        fn(xq.data() + m * K, K, xs.data() + m * KB, xc.data() + m * KB, xsum.data() + m * KB, KB, cp + b * KB * CB,
           sp + b * KB * S * BN, S, z, bp, op + m * N, N, b * BN, N);
      }
    }
#endif
  });
  return out;
}

bool has_vnni() {
#ifdef LADDER_VNNI
  return true;
#else
  return false;
#endif
}
"""

_extension = LazyExtension("ladder_cpu_w4a8_linear", SOURCE, ["w4a8_linear", "has_vnni"], "CPU W4A8 linear kernel")


def load():
    """The compiled module, or None when it cannot be built here."""
    return _extension.load()


def has_vnni() -> bool:
    """Whether the build has the AVX-512 VNNI tiles (else every call runs the portable loop)."""
    module = load()
    return module is not None and module.has_vnni()


def quantize_blocks_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 (K a multiple of 32) -> (a int8 [M, K], s [M, K / 32], s * sum(a) per block)."""
    m, k = x.shape
    xb = x.view(m, k // BLOCK_K, BLOCK_K)
    s = xb.abs().amax(dim=-1).clamp(min=1e-12) / 127  # [M, KB]
    a = torch.round(xb / s[..., None]).to(torch.int8)  # |x / s| <= 127 by construction
    return a.view(m, k), s, s * a.sum(dim=-1, dtype=torch.int32).float()


def w4a8_matmul_ref(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None,
                    zero: int = 0) -> torch.Tensor:
    """The reference: x [M, K] float32 quantized per 32-block, times weights w = d * codes + m (m given) or
    w = d * (codes - zero) (m None), codes uint8 [N, K] (0..15 or 0..255), d and m float32 [N, K / 32]
    -> [M, N] float32."""
    rows, k = x.shape
    a, s, c = quantize_blocks_ref(x)
    # The integer products run on int8 codes: codes - zero fits, and so does codes - 128 (added back as
    # 128 * sum(a)) for codes that carry their own m.
    shift = 128 if m is not None else zero
    signed = (codes.to(torch.int16) - shift).to(torch.int8)
    y = x.new_zeros(rows, codes.shape[0])
    for b in range(k // BLOCK_K):
        cols = slice(b * BLOCK_K, (b + 1) * BLOCK_K)
        dot = torch._int_mm(a[:, cols], signed[:, cols].t())  # [M, N] int32, exact
        if m is None:
            y = y + (dot.float() * s[:, b:b + 1]) * d[:, b]
        else:
            dot = dot + 128 * a[:, cols].sum(dim=-1, keepdim=True, dtype=torch.int32)
            y = (y + (dot.float() * s[:, b:b + 1]) * d[:, b]) + m[:, b] * c[:, b:b + 1]
    return y


def pack(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bits: int
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """codes uint8 [N, K] (bits 4: 0..15; 8: 0..255), d and m float16 [N, K / 32] (m None: w = d * (u -
    zero), the kernel's `zero`) -> (codes [ceil(N / 16), K / 32, 256 or 512] uint8, scales [ceil(N / 16), K / 32, 1 or
    2, 16] float16), zero-padded to whole blocks of 16 outputs."""
    if codes.dim() != 2 or codes.dtype != torch.uint8 or codes.shape[1] % BLOCK_K:
        raise ValueError(f"expected uint8 codes [N, K] with K a multiple of {BLOCK_K}, got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    n, k = codes.shape
    blocks, kb = -(-n // BLOCK_N), k // BLOCK_K
    padded = codes.new_zeros(blocks * BLOCK_N, k)
    padded[:n] = codes
    # [blocks, 16, kb, 8 groups, 4] -> [blocks, kb, 8, 16, 4]
    grouped = padded.view(blocks, BLOCK_N, kb, 8, GROUP_K).permute(0, 2, 3, 1, 4)
    if bits == 4:
        if codes.numel() and int(codes.max()) > 15:
            raise ValueError("4-bit codes must be in 0..15")
        grouped = grouped[:, :, :4] | (grouped[:, :, 4:] << 4)  # inputs 16.. in the high nibbles
    packed = grouped.contiguous().view(blocks, kb, -1)
    parts = [d] if m is None else [d, m]
    scales = torch.zeros(blocks * BLOCK_N, kb, len(parts), dtype=torch.float16)
    for i, part in enumerate(parts):
        scales[:n, :, i] = part.to(torch.float16)
    scales = scales.view(blocks, BLOCK_N, kb, len(parts)).permute(0, 2, 3, 1).contiguous()
    return packed, scales


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `pack`'s codes: uint8 [N, K]."""
    blocks, kb, cb = packed.shape
    grouped = packed.view(blocks, kb, cb // (BLOCK_N * GROUP_K), BLOCK_N, GROUP_K)
    if cb == 256:
        grouped = torch.cat([grouped & 0x0F, grouped >> 4], dim=2)
    return grouped.permute(0, 3, 1, 2, 4).reshape(blocks * BLOCK_N, kb * BLOCK_K)[:n]


def scales_of(scales: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`pack`'s scales as float32: d [N, KB] and m [N, KB] (None where the format implies it)."""
    per_row = scales.permute(0, 3, 1, 2).reshape(-1, scales.shape[1], scales.shape[2])[:n].float()
    return per_row[:, :, 0], (per_row[:, :, 1] if scales.shape[2] == 2 else None)


def _reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, n: int,
               zero: int) -> torch.Tensor:
    """`w4a8_linear` by the torch reference, from the packed weight."""
    k = x.shape[-1]
    d, m = scales_of(scales, n)
    y = w4a8_matmul_ref(x.reshape(-1, k).float(), unpack(codes, n), d, m, zero)
    return (y if bias is None else y + bias.float()).view(*x.shape[:-1], n)


def w4a8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, n: int,
                zero: int = 0, portable: bool = False) -> torch.Tensor:
    """y [..., N] float32 = x [..., K] times the packed weight (`pack`), + bias; equal bit for bit to
    `w4a8_matmul_ref` on the unpacked codes and scales. `zero`: w = d * (u - zero) when the scales hold d
    only (Q4_0: 8, Q8_0 stored as q + 128: 128)."""
    module = load() if cpu_kernels_enabled() and x.device.type == "cpu" else None
    if module is None:
        return _reference(x, codes, scales, bias, n, zero)
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    return module.w4a8_linear(x, codes, scales, bias, n, zero, portable)


if __name__ == "__main__":
    import sys

    sys.exit(_extension.build_and_report())
