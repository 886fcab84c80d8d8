// The kernels' bodies on raw float32 rows, shared by their custom ops and by the decoder step
// (decoder_step.cpp), which chains them with no Python or dispatcher between them. Each is defined once,
// in its kernel's source, and never inlined into a caller (LADDER_SHARED): the op and the step then run
// the same machine code, so their results are equal bit for bit.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <vector>

#define LADDER_SHARED __attribute__((noinline))

namespace ladder {

// fused_ops.cpp --------------------------------------------------------------------------------------

// out[d] = w[d] * (x[d] * rsqrt(mean(x^2) + eps)), one row of D floats.
LADDER_SHARED void rms_norm_row(const float* x, const float* w, float eps, int64_t D, float* out);

// sum = x + residual, out = rms_norm_row(sum): one row of D floats.
LADDER_SHARED void add_rms_norm_row(const float* x, const float* residual, const float* w, float eps, int64_t D, float* sum,
                      float* out);

// In place: T tokens of H heads of 2 * half floats, token t's head h at x + t * token_stride + h *
// head_stride, rotated by cos, sin [T, half]: (a, b) -> (a cos - b sin, b cos + a sin) for halves a, b.
LADDER_SHARED void rotate_rows(float* x, int64_t T, int64_t H, int64_t token_stride, int64_t head_stride, const float* cos,
                 const float* sin, int64_t half);

// out [T, I] = silu(gate) * up for gate_up [T, 2 * I] (gate first); silu(g) = g / (1 + exp(-g)).
LADDER_SHARED void silu_and_mul_rows(const float* gate_up, int64_t T, int64_t I, float* out);

// The same with gelu's tanh approximation (Gemma's GeGLU): gelu(g) = g / (1 + exp(-2 sqrt(2 / pi) (g +
// 0.044715 g^3))), which is 0.5 g (1 + tanh(...)).
LADDER_SHARED void gelu_tanh_and_mul_rows(const float* gate_up, int64_t T, int64_t I, float* out);
// GPT-OSS's experts: g = min(gate, limit), u = clamp(up, -limit, limit) -> g / (1 + exp(-alpha g)) * (u + 1).
// In place: out[t * n + j] *= sigmoid(gate[t * gate_stride + j]) for T rows of n (Qwen3.5's attention output gate),
// sigmoid(g) = 1 / (1 + exp(-g)).
LADDER_SHARED void sigmoid_gate_rows(float* out, const float* gate, int64_t T, int64_t n, int64_t gate_stride);
LADDER_SHARED void clamped_swiglu_rows(const float* gate_up, int64_t T, int64_t I, float alpha, float limit,
                                       float* out);

// w4a8_linear.cpp ------------------------------------------------------------------------------------

// Table codes (kTableCodes, MXFP4's): 4-bit indices into the block's own 16-byte table of 8-bit codes.
constexpr int kTableCodes = 7;

// Bytes of packed codes per 16 outputs and 32-block (kernels/cpu_w4a8_linear.py CODE_BYTES): 4-bit
// nibbles (256), the same nibbles and a 64-byte plane of fifth bits (320), those, a plane of sixth bits and
// 32 int8 sub-scales (416), one byte a code (512), table codes' nibbles and their 16-byte table (272).
constexpr int64_t w4a8_code_bytes(int bits) {
  return bits == 4 ? 256 : bits == 5 ? 320 : bits == 6 ? 416 : bits == 8 ? 512 : bits == kTableCodes ? 272 : 0;
}

// The code width of a packed weight of CB bytes a block: 4, 5, 6 or 8, kTableCodes, or 0 for none of them.
constexpr int w4a8_code_bits(int64_t CB) {
  return CB == 256 ? 4 : CB == 320 ? 5 : CB == 416 ? 6 : CB == 512 ? 8 : CB == 272 ? kTableCodes : 0;
}

// A packed W4A8 weight (kernels/cpu_w4a8_linear.py `pack`): codes [NBLK, KB, w4a8_code_bytes(bits)] uint8,
// scales [NBLK, KB, S, 16] float16 bits, bias [N] or nullptr.
struct W4A8Weight {
  const uint8_t* codes;
  const uint16_t* scales;
  const float* bias;
  int64_t N, K, NBLK;
  int S;
  int bits;
  int32_t zero;
};

// The activations of M rows quantized per 32-block, reused from call to call: codes, scale, scale times
// the codes' sum, that sum, and the sum of the block's first 16 codes (6-bit weights weigh the halves apart).
struct W4A8Scratch {
  std::vector<int8_t> xq;
  std::vector<float> xs, xc;
  std::vector<int32_t> xsum, xlo;
};

// out [M, N] = x [M, K] times the weight; `portable`: the portable loop even where tiles exist.
LADDER_SHARED void w4a8_rows(const float* x, int64_t M, const W4A8Weight& w, float* out, W4A8Scratch& scratch, bool portable);

// w4a8_experts.cpp -----------------------------------------------------------------------------------

// E experts' W4A8 weights of one shape, each packed as cpu_w4a8_linear.pack packs a weight, stacked:
// codes [E, NBLK, KB, CB] uint8, scales [E, NBLK, KB, S, 16] float16 bits.
struct W4A8Stack {
  const uint8_t* codes;
  const uint16_t* scales;
  int64_t E, N, NBLK, KB, S;
  int bits;
  int32_t zero;

  W4A8Weight expert(int64_t e) const {
    return W4A8Weight{codes + e * NBLK * KB * w4a8_code_bytes(bits), scales + e * NBLK * KB * S * 16, nullptr, N,
                      KB * 32, NBLK, static_cast<int>(S), bits, zero};
  }
};

// out [T, H] = sum over each row's k slots of weights[t, slot] * expert(x[t]), slots in order, for the
// experts of `experts` [T, k] (the router's numbering) that the stacks hold: experts expert_offset ..
// expert_offset + E - 1 (a pair routed elsewhere adds 0). expert(x) = w2 (silu(gate) * up), or with `gelu`
// w2 (gelu_tanh(gate) * up) (Gemma 4's experts), gate and up the rows of w13 [2I, H] (I = w2's K), x [T, H]
// float32. GPT-OSS's: b13 [E, 2I] and b2 [E, H] each expert's biases, and with swiglu_limit > 0 the clamped
// SwiGLU (clamped_swiglu_rows) in place of the gate.
LADDER_SHARED void w4a8_experts_rows(const float* x, int64_t T, int64_t H, const float* weights, const int64_t* experts,
                       int64_t k, const W4A8Stack& w13, const W4A8Stack& w2, int64_t expert_offset, float* out,
                       W4A8Scratch& scratch, bool gelu = false, const float* b13 = nullptr,
                       const float* b2 = nullptr, float swiglu_limit = 0.f, float swiglu_alpha = 1.f);

// The stack of a MoE layer's packed expert tensors (checked: their shapes, dtypes, N rows an expert).
W4A8Stack w4a8_stack(const at::Tensor& codes, const at::Tensor& scales, int64_t N, int64_t zero, const char* name);

// w8a8_linear.cpp ------------------------------------------------------------------------------------

// A packed W8A8 weight (kernels/cpu_w8a8_linear.py `pack`): packed [NBLK, ceil(K / 4), 16, 4] int8, wsum
// [NBLK * 16] int32, scale [N] and bias [N] (or nullptr) float32.
struct W8A8Weight {
  const int8_t* packed;
  const int32_t* wsum;
  const float* scale;
  const float* bias;
  int64_t N, K, NBLK;
};

// Each row's activations quantized to int8 (as unsigned bytes), and its scale.
struct W8A8Scratch {
  std::vector<uint8_t> xq;
  std::vector<float> xs;
};

// out [M, N] = x [M, K] times the weight, each row quantized with its own max |x|.
LADDER_SHARED void w8a8_rows(const float* x, int64_t M, const W8A8Weight& w, float* out, W8A8Scratch& scratch);

// lora.cpp -------------------------------------------------------------------------------------------

// The column bounds of a LoRA's P parts, checked: splits empty (one part, 0 .. N) or 0 = c_0 < ... < c_P = N,
// with the rank R divisible by P.
std::vector<int64_t> lora_bounds(c10::IntArrayRef splits, int64_t N, int64_t R);

// out [T, N] = y [T, N] plus, for each row t with a slot s = slot[t] >= 0 (-1: none), (x[t] @ a[s].T) @ b[s]
// by parts (the P + 1 column `bounds`): x [T, K], a [S, R, K], b [S, R, N] (kernels/csrc/lora.cpp). out must
// not overlap y or x. `portable`: the portable loop even where the AVX2 tiles exist.
LADDER_SHARED void lora_add_rows(const float* y, const float* x, const float* a, const float* b, const int64_t* slot,
                                 int64_t T, int64_t K, int64_t N, int64_t S, int64_t R, const int64_t* bounds, int64_t P,
                                 float* out, bool portable);

// gated_delta.cpp ------------------------------------------------------------------------------------

// One new token of each of B sequences through a linear-attention layer (Qwen3.5's gated delta rule), from its
// input projection's rows (`projected`, B rows of `width` = C + Hv Dv + 2 Hv floats: the convolution's input, z,
// b, a) to its output projection's input (`out`, B rows of Hv Dv); sequence b's state in row slots[b] of `pool`
// (rows of `state_width` floats: the convolution's last K - 1 inputs [K - 1, C], then Hv matrices [Dk, Dv]),
// advanced in place. taps [K, C]; a_log, dt_bias [Hv]; norm [Dv]; `tiled`: value head h reads key head h % Hk
// (else h / (Hv / Hk)). Each (sequence, head) is computed alone, in one order whatever the batch.
LADDER_SHARED void gated_delta_rows(const float* projected, int64_t B, int64_t width, float* pool, int64_t state_width,
                                    const int64_t* slots, const float* taps, int64_t K, int64_t C, const float* a_log,
                                    const float* dt_bias, const float* norm, int64_t Hk, int64_t Dk, int64_t Dv,
                                    int64_t Hv, bool tiled, float eps, float* out);

// decode_attention.cpp -------------------------------------------------------------------------------

// Paged decode attention of float32 queries over a float32, bfloat16 or float16 cache, one query row per
// sequence entry: q row s at q + s * q_stride holds H heads of D floats; k, v the cache's halves
// [num_blocks, BS, KVH, D]; tables [S, max_blocks], seq_lens [S]; out row s at out + s * out_stride (float32).
// `window` > 0: the last `window` keys only. `sinks` [H]: each query head's sink logit (GPT-OSS), or null.
LADDER_SHARED void decode_attention_rows(const float* q, int64_t q_stride, const float* k, const float* v, const int64_t* tables,
                           int64_t max_blocks, const int64_t* seq_lens, int64_t S, int64_t H, int64_t KVH,
                           int64_t D, int64_t BS, float scale, int64_t window, float* out, int64_t out_stride,
                           const float* sinks = nullptr);
LADDER_SHARED void decode_attention_rows(const float* q, int64_t q_stride, const c10::BFloat16* k,
                           const c10::BFloat16* v, const int64_t* tables, int64_t max_blocks, const int64_t* seq_lens,
                           int64_t S, int64_t H, int64_t KVH, int64_t D, int64_t BS, float scale, int64_t window,
                           float* out, int64_t out_stride, const float* sinks = nullptr);
LADDER_SHARED void decode_attention_rows(const float* q, int64_t q_stride, const c10::Half* k, const c10::Half* v,
                           const int64_t* tables, int64_t max_blocks, const int64_t* seq_lens, int64_t S, int64_t H,
                           int64_t KVH, int64_t D, int64_t BS, float scale, int64_t window, float* out,
                           int64_t out_stride, const float* sinks = nullptr);

}  // namespace ladder
