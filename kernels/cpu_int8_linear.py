"""Weight-only INT8 linear for the CPU: y = x @ (weight * scale[:, None]).T (+ bias), float32 accumulation.

torch's own `_weight_int8pack_mm` is several times slower than a float32 `F.linear` on AVX-512 CPUs, so
this is a small C++ kernel. The weights are repacked once (`pack`) into blocks of 16 output channels
interleaved per k, [ceil(N / 16), K, 16] int8, zero-padded: for one k the micro-kernel loads 16 int8,
widens them to 16 floats and multiplies them into up to 8 rows of x at once, keeping 16-wide float32
accumulators in registers; the per-channel scale (and the bias) is applied once at the end. Threads split
the blocks of output channels. A scalar loop over the same layout is compiled where AVX-512 is missing.

It is compiled on first use with torch's C++ extension builder (a C++ compiler and ninja are needed; the
build is cached). If it cannot be built, or LADDER_CPU_KERNELS=0, `int8_linear` falls back to the torch
reference (dequantize + F.linear). `int8_linear` is the custom op `ladder::int8_linear`, so torch.compile
keeps it as one opaque call. The op is defined in Python (schema, fake, fallback), and the compiled library
registers a C++ CPU kernel for it when it loads, so a call under inference mode never enters Python.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_extension import LazyExtension, cpu_kernels_enabled

BLOCK_N = 16  # output channels interleaved per k in the packed layout

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

// Packed weight: [NBLK, K, 16] int8, block b holds output channels 16b .. 16b+15 (zero rows past N).
constexpr int BN = 16;
constexpr int MAX_MR = 8;

#ifdef __AVX512F__
static inline __mmask16 tail_mask(int64_t left) {
  return left >= BN ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
}

// MR rows of x times NB consecutive blocks of 16 output channels, over the whole of K.
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

// The widest group of blocks whose accumulators (MR * NB) and widened weights (NB) fit the 32 registers.
static inline int max_nb(int mr) {
  static const int table[MAX_MR + 1] = {0, 8, 6, 4, 4, 4, 3, 3, 3};
  return table[mr];
}

using TileFn = void (*)(const float*, int64_t, const int8_t*, int64_t, const float*, const float*, float*,
                        int64_t, int64_t, int64_t);

template <int MR>
static TileFn pick_nb(int nb) {
  switch (nb) {
    case 1: return tile<MR, 1>;
    case 2: return tile<MR, 2>;
    case 3: return tile<MR, 3>;
    case 4: if constexpr (MR <= 5) return tile<MR, 4>; break;
    case 5: if constexpr (MR <= 2) return tile<MR, 5>; break;
    case 6: if constexpr (MR <= 2) return tile<MR, 6>; break;
    case 7: if constexpr (MR <= 1) return tile<MR, 7>; break;
    case 8: if constexpr (MR <= 1) return tile<MR, 8>; break;
  }
  TORCH_CHECK(false, "no ", MR, "x", nb, " tile");
}

static TileFn pick(int mr, int nb) {
  switch (mr) {
    case 1: return pick_nb<1>(nb);
    case 2: return pick_nb<2>(nb);
    case 3: return pick_nb<3>(nb);
    case 4: return pick_nb<4>(nb);
    case 5: return pick_nb<5>(nb);
    case 6: return pick_nb<6>(nb);
    case 7: return pick_nb<7>(nb);
    case 8: return pick_nb<8>(nb);
  }
  TORCH_CHECK(false, "no ", mr, "-row tile");
}

// x [M, K] float32 contiguous; packed [NBLK, K, 16] int8; scale [N] float32; bias [N] float32 or empty.
// Returns [M, N] float32.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale,
                          c10::optional<torch::Tensor> bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: [M, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kChar && packed.is_contiguous() &&
              packed.size(2) == BN, "packed: [NBLK, K, 16] int8");
  const int64_t M = x.size(0), K = x.size(1), NBLK = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "packed K ", packed.size(1), " != x K ", K);
  TORCH_CHECK(N > (NBLK - 1) * BN && N <= NBLK * BN, "n ", N, " does not match ", NBLK, " packed blocks");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.is_contiguous() && scale.numel() == N, "scale: [N] float32");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == N,
                "bias: [N] float32");
    bp = bias->data_ptr<float>();
  }
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int main_mr = static_cast<int>(std::min<int64_t>(M, MAX_MR));
  const int group = max_nb(main_mr);
  // Each thread gets at least ~64K multiply-adds (about a microsecond): tiny problems stay on one thread.
  const int64_t per_block = std::max<int64_t>(1, M * K * BN);
  const int64_t grain = std::max<int64_t>(1, ((int64_t)65536 + per_block - 1) / per_block);
  at::parallel_for(0, NBLK, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b += group) {
      const int nb = static_cast<int>(std::min<int64_t>(group, b1 - b));
      const int8_t* wb = wp + b * K * BN;
      for (int64_t m = 0; m < M; m += MAX_MR) {
        const int mr = static_cast<int>(std::min<int64_t>(MAX_MR, M - m));
        pick(mr, std::min(nb, max_nb(mr)))(xp + m * K, K, wb, K, sp, bp, op + m * N, N, b * BN, N);
        // max_nb(mr) >= max_nb(MAX_MR) >= nb whenever mr < main_mr, so the call covers all nb blocks.
      }
    }
  });
  return out;
}

// The torch path, for LADDER_CPU_KERNELS=0: dequantize the packed weight and run a float32 linear.
static torch::Tensor int8_linear_ref(const torch::Tensor& x, const torch::Tensor& packed,
                                     const torch::Tensor& scale, const c10::optional<torch::Tensor>& bias,
                                     int64_t n) {
  const int64_t K = packed.size(1);
  auto weight = packed.transpose(1, 2).reshape({-1, K}).narrow(0, 0, n).to(torch::kFloat) *
                scale.to(torch::kFloat).unsqueeze(1);
  c10::optional<torch::Tensor> b;
  if (bias.has_value() && bias->defined()) b = bias->to(torch::kFloat);
  return at::linear(x.to(torch::kFloat), weight, b).to(x.scalar_type());
}

// ladder::int8_linear for CPU tensors, straight from the dispatcher (no Python on the way): x [..., K]
// float32 or bfloat16 -> [..., n] of x's dtype.
static torch::Tensor int8_linear_op(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scale,
                                    const c10::optional<torch::Tensor>& bias, int64_t n) {
  const char* env = std::getenv("LADDER_CPU_KERNELS");
  if (env != nullptr && std::strcmp(env, "0") == 0) return int8_linear_ref(x, packed, scale, bias, n);
  TORCH_CHECK(x.dim() >= 1, "x must have a last dimension");
  const int64_t K = x.size(-1);
  auto x2 = x.reshape({-1, K}).to(torch::kFloat).contiguous();
  c10::optional<torch::Tensor> b;
  if (bias.has_value() && bias->defined()) b = bias->to(torch::kFloat).contiguous();
  auto out = int8_linear(x2, packed.contiguous(), scale.to(torch::kFloat).contiguous(), b, n);
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  return out.view(sizes).to(x.scalar_type());
}

// The op itself (schema, fake, fallback) is defined in Python with torch.library.custom_op before this
// library is loaded; this CPU kernel takes precedence over the Python one for CPU tensors.
TORCH_LIBRARY_IMPL(ladder, CPU, m) { m.impl("int8_linear", &int8_linear_op); }
"""

# Loading it also registers the C++ CPU kernel of ladder::int8_linear.
_extension = LazyExtension("ladder_cpu_int8_linear", SOURCE, ["int8_linear"], "CPU int8 linear kernel")


def load():
    """The compiled module, or None when it cannot be built here."""
    return _extension.load()


def is_enabled() -> bool:
    return cpu_kernels_enabled()


def available() -> bool:
    """Whether `int8_linear` runs the C++ kernel (built here and not switched off by LADDER_CPU_KERNELS=0)."""
    return is_enabled() and load() is not None


def pack(weight_int8: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> the kernel's layout, int8 [ceil(N / 16), K, 16], output channels past N zero."""
    if weight_int8.dim() != 2 or weight_int8.dtype != torch.int8:
        raise ValueError(f"expected an int8 [N, K] weight, got {weight_int8.dtype} {tuple(weight_int8.shape)}")
    n, k = weight_int8.shape
    blocks = -(-n // BLOCK_N)
    padded = weight_int8.new_zeros(blocks * BLOCK_N, k)
    padded[:n] = weight_int8
    return padded.view(blocks, BLOCK_N, k).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `pack`: int8 [ceil(N / 16), K, 16] -> int8 [N, K]."""
    blocks, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(blocks * BLOCK_N, k)[:n]


def int8_linear_ref(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    n: int) -> torch.Tensor:
    """The torch path: dequantize the packed weight and run F.linear in float32; returns x's dtype."""
    weight = unpack(packed, n).float() * scale.float()[:, None]
    out = F.linear(x.float(), weight, None if bias is None else bias.float())
    return out.to(x.dtype)


@torch.library.custom_op("ladder::int8_linear", mutates_args=())
def _int8_linear_op(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    n: int) -> torch.Tensor:
    # Loading the C++ library also registers its own CPU kernel for this op, which the dispatcher then
    # prefers for CPU tensors: after the first call, this body only runs where that kernel is missing.
    module = load() if is_enabled() and x.device.type == "cpu" else None
    if module is None:
        return int8_linear_ref(x, packed, scale, bias, n)
    check_devices(x, packed, scale, bias)
    k = x.shape[-1]
    x2 = x.reshape(-1, k).float().contiguous()
    out = module.int8_linear(x2, packed.contiguous(), scale.float().contiguous(),
                             None if bias is None else bias.float().contiguous(), n)
    return out.view(*x.shape[:-1], n).to(x.dtype)


@_int8_linear_op.register_fake
def _(x, packed, scale, bias, n):
    return x.new_empty(x.shape[:-1] + (n,))


def check_devices(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    """All on one device: the C++ kernel reads host pointers, so a CUDA tensor among CPU ones would be
    read as host memory."""
    tensors = {"x": x, "packed": packed, "scale": scale} | ({} if bias is None else {"bias": bias})
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        where = ", ".join(f"{name} on {t.device}" for name, t in tensors.items())
        raise ValueError(f"int8_linear: tensors must share one device, got {where}")


def int8_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                n: int) -> torch.Tensor:
    """y [..., N] = x [..., K] @ (weight * scale[:, None]).T (+ bias), with `packed = pack(weight)`.

    x is float32 or bfloat16 (computed in float32, returned in x's dtype); scale and bias are [N]."""
    check_devices(x, packed, scale, bias)  # shapes and dtypes: the C++ kernel's own checks
    return torch.ops.ladder.int8_linear(x, packed, scale, bias, n)


if __name__ == "__main__":
    import sys

    sys.exit(_extension.build_and_report())
