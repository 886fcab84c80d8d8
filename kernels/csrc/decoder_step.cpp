// The decoder's layers as one C++ call, for float32 activations and int8 linears on the CPU: a step's rows go
// through every layer (norms, the four linears, the rotary embedding, the cache write, paged attention, the
// gated activation) with no Python and no dispatcher between the kernels, into buffers kept from step to
// step. At batch 1 a decode step of a small model was a third Python and dispatch (about 600 calls of a few
// microseconds each); here it is one call.
//
// Each part runs the same function as its custom op (cpu_kernels.h), in the order the eager module
// (model/llama.py) calls them, so the hidden states equal the eager model's bit for bit
// (tests/model/test_cpu_step.py), and they keep its batch invariance: every row is computed alone. The
// layouts it covers: Llama, Mistral, Qwen2 (q/k/v biases), Qwen3 (q/k norms), Gemma 3 (q/k norms, sandwich
// norms, GeGLU, sliding-window layers with their own rotary tables and KV blocks beside full ones) and Gemma 4
// (each layer its own head size and KV heads, values from the keys' projection, normed values, layers that
// read an earlier layer's cache, per-layer embeddings gated into each layer's output, a scale on the whole
// stream), each linear W4A8 (a GGUF's blocks) or W8A8, with or without LoRA slots (set_lora: a row's adapter
// added to the linear's output by lora_add_rows, as the eager LoRALinear adds it).
//
// DecoderStep(tensors, ints, eps), built once per model (model/cpu_step.py):
//   tensors: per layer kTensorsPerLayer, in order: input_layernorm, post_attention_layernorm,
//            pre_feedforward_layernorm, post_feedforward_layernorm ([hidden] each; the last two Gemma's
//            sandwich norms), q_norm, k_norm ([head_dim]); then qkv, o, gate_up, down, four tensors each:
//            W4A8 (codes, scales, -, bias), W8A8 (packed, wsum, scale, bias). An absent one is an empty
//            tensor. Then the final norm [hidden].
//            A mixture-of-experts layer (kind 2 for gate_up and down) puts its experts' W4A8 stacks there:
//            gate_up (w13 codes, w13 scales, the float32 router [E, hidden], -), down (w2 codes, w2 scales, -, -).
//            Then Gemma 4's: layer_scalar [1], the per-layer embedding's gate [P, hidden] and projection
//            [hidden, P] (four tensors each, as above) and its norm [hidden]; then 26B-A4B's experts beside
//            the MLP: the router's float32 proj [E, hidden], scale [hidden] and per-expert scale [E], the
//            experts' W4A8 stacks (w13 codes, scales, w2 codes, scales) and the norms of their input, of the
//            MLP's output and of theirs [hidden] (empty all: not Gemma 4, or not its experts). Then Qwen3.5's
//            linear attention: the convolution's taps [K, C], A_log and dt_bias [Hv], the output norm [Dv] (empty
//            all for an attention layer); a linear-attention layer's qkv and o places hold its in_proj and out_proj.
//            Then Qwen3.5-MoE's shared expert: its gate_up and down linears (four tensors each, as above) and the
//            float32 gate [1, hidden] (empty all: none).
//   ints:    hidden, heads, kv_heads, head_dim, intermediate, gelu (1: GeGLU), P (Gemma 4's per-layer embedding
//            size; 0: none), then per layer: windowed (1: the layer reads the local tables and rotates by the
//            local cos/sin), per linear kind (0 W4A8, 1 W8A8, 2 a MoE layer's experts) and zero (W4A8's
//            implied offset), then top_k and renormalize (a MoE layer's; 0 else), then the layer's head_dim,
//            kv_heads, intermediate, projections (2: q/k/v; 1: q/k, values the keys' projection; 0: q only, the
//            layer reads layer `source`'s cache, written by that layer), source, value_norm (1: values
//            RMS-normalised without a weight), and the kinds and zeros of the per-layer gate and projection;
//            then experts beside the MLP (1: Gemma 4's), their top_k and the w13 and w2 zeros; then linear (1: the
//            layer's token mixer is Qwen3.5's gated delta rule), gate (1: attention's output times the sigmoid of
//            gates the qkv linear projects after the values), the linear attention's key heads, key and value head
//            sizes, and tiled (1: value head h reads key head h % Hk); then the shared expert's width (0: none)
//            and its gate_up's and down's kinds and zeros.
// forward(x [T, hidden], cos, sin, local_cos, local_sin [T, head_dim / 2] (of the full and windowed layers'
//   head sizes), kv_caches (one [2, blocks, block_size, kv_heads, head_dim] per layer, all float32, all
//   bfloat16 or all float16: keys and values are rounded to the cache's type as they are written, as torch's
//   conversion rounds them), slot_mapping [T], block_tables [T, max_blocks], seq_lens [T] and the same three
//   for the windowed layers, scale, window, lora_slots ([T] int64, each row's LoRA slot or -1; empty: no
//   adapter this step), per_layer_inputs ([T, layers, P] float32; empty without), q_scale ([T] float32, each
//   token's queries multiplied by it after their rotation: Llama 4's attention temperature; empty without),
//   state_slots ([T] int64, each row's state in the linear-attention layers' pools, whose kv_caches entries they
//   are: [S, (K - 1) C + Hv Dk Dv] float32; empty without such layers)) -> final hidden [T, hidden].
//   Each row is a decode row: token t sees seq_lens[t] keys, its own included; a windowed layer the last
//   `window` of them.
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_kernels.h"
#include "parallel.h"

namespace ladder {
namespace {

constexpr int64_t kTensorsPerLayer = 55;
constexpr int64_t kIntsPerLayer = 36;
constexpr int64_t kHeaderInts = 7;

// The parts of a step `profile` times, in the order of DecoderStep::take_profile's list.
enum Part { kNorms, kQkv, kRotary, kAttention, kO, kGateUp, kAct, kDown, kExperts, kParts };

// One linear of a layer, W4A8 or W8A8, and the LoRA slots on it (set_lora), if any.
struct Linear {
  int64_t kind = 0;  // 0 W4A8, 1 W8A8
  at::Tensor a, b, c, bias;
  int64_t n = 0, k = 0, zero = 0;
  at::Tensor lora_a, lora_b;          // [S, R, k] and [S, R, n] float32, the eager wrapper's own tensors
  std::vector<int64_t> lora_bounds;  // its parts' column bounds

  // out [M, n] = the linear of x [M, k]; with `lora_rows` (a slot or -1 per row) and slots on this linear,
  // plus each row's adapter, added to the linear's output in `base` as the eager wrapper adds it.
  void run(const float* x, int64_t M, float* out, W4A8Scratch& s4, W8A8Scratch& s8, const int64_t* lora_rows,
           std::vector<float>& base) const {
    if (lora_rows && lora_a.defined()) {
      base.resize(M * n);
      run(x, M, base.data(), s4, s8, nullptr, base);
      lora_add_rows(base.data(), x, lora_a.data_ptr<float>(), lora_b.data_ptr<float>(), lora_rows, M, k, n,
                    lora_a.size(0), lora_a.size(1), lora_bounds.data(), static_cast<int64_t>(lora_bounds.size()) - 1,
                    out, false);
      return;
    }
    const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
    if (kind == 0) {
      w4a8_rows(x, M, W4A8Weight{a.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(b.data_ptr<at::Half>()), bp,
                                 n, k, a.size(0), static_cast<int>(b.size(2)), w4a8_code_bits(a.size(2)),
                                 static_cast<int32_t>(zero)}, out, s4, false);
    } else {
      w8a8_rows(x, M, W8A8Weight{a.data_ptr<int8_t>(), b.data_ptr<int32_t>(), c.data_ptr<float>(), bp, n, k, a.size(0)},
                out, s8);
    }
  }
};

// A tensor that may be absent (empty): undefined then.
at::Tensor optional(const at::Tensor& t) { return t.numel() ? t.contiguous() : at::Tensor(); }

Linear make_linear(const std::vector<at::Tensor>& t, int64_t at, int64_t kind, int64_t zero, int64_t n, int64_t k) {
  Linear l{kind, t[at].contiguous(), t[at + 1].contiguous(), optional(t[at + 2]), optional(t[at + 3]), n, k, zero};
  const int64_t blocks = (n + 15) / 16;
  if (kind == 0) {
    TORCH_CHECK(l.a.scalar_type() == at::kByte && l.a.dim() == 3 && w4a8_code_bits(l.a.size(2)) != 0 &&
                l.a.size(1) * 32 == k && l.a.size(0) == blocks, "DecoderStep: W4A8 codes of a [", n, ", ", k,
                "] linear expected");
    TORCH_CHECK(l.b.scalar_type() == at::kHalf && l.b.dim() == 4 && l.b.size(0) == blocks && l.b.size(1) == l.a.size(1) &&
                l.b.size(3) == 16 && (l.b.size(2) == 1 || l.b.size(2) == 2), "DecoderStep: W4A8 scales expected");
  } else {
    TORCH_CHECK(kind == 1, "DecoderStep: linear kind 0 (W4A8) or 1 (W8A8), got ", kind);
    TORCH_CHECK(l.a.scalar_type() == at::kChar && l.a.dim() == 4 && l.a.size(0) == blocks &&
                l.a.size(1) == (k + 3) / 4 && l.a.size(2) == 16 && l.a.size(3) == 4,
                "DecoderStep: W8A8 packed weight of a [", n, ", ", k, "] linear expected");
    TORCH_CHECK(l.b.scalar_type() == at::kInt && l.b.numel() == blocks * 16, "DecoderStep: W8A8 wsum expected");
    TORCH_CHECK(l.c.defined() && l.c.scalar_type() == at::kFloat && l.c.numel() == n, "DecoderStep: W8A8 scale [", n,
                "] float32 expected");
  }
  TORCH_CHECK(!l.bias.defined() || (l.bias.scalar_type() == at::kFloat && l.bias.numel() == n),
              "DecoderStep: a bias of ", n, " floats expected");
  return l;
}

// A mixture-of-experts MLP: the float router and the experts' W4A8 stacks (their tensors held here).
struct Experts {
  at::Tensor router, w13_codes, w13_scales, w2_codes, w2_scales;
  W4A8Stack w13{}, w2{};
  int64_t top_k = 0;
  bool renormalize = false;
};

// Gemma 4's experts beside a dense MLP (26B-A4B): its router's tensors and the experts' W4A8 stacks.
struct BesideExperts {
  at::Tensor proj, scale, per_expert_scale, w13_codes, w13_scales, w2_codes, w2_scales;
  at::Tensor input_norm, mlp_norm, experts_norm;  // pre_feedforward_layernorm_2, post_..._1, post_..._2
  W4A8Stack w13{}, w2{};
  int64_t top_k = 0;
};

struct Layer {
  at::Tensor input_norm, post_attention_norm, pre_feedforward_norm, post_feedforward_norm, q_norm, k_norm;
  Linear qkv, o, gate_up, down;
  bool windowed = false;
  bool moe = false;  // the MLP is `experts`, not gate_up and down
  Experts experts;
  // Gemma 4 (the model's defaults else): this layer's attention shape and MLP width, what its qkv linear
  // projects (2: q/k/v, 1: q/k with values from the keys, 0: q alone over layer `source`'s cache), the values'
  // norm, the scale on its output, and its per-layer embedding's gate, projection and norm.
  int64_t head_dim = 0, kv_heads = 0, inter = 0, projections = 2, source = 0;
  bool value_norm = false;
  at::Tensor scalar, ple_norm;
  Linear ple_gate, ple_proj;
  bool beside = false;  // Gemma 4's experts beside the MLP
  BesideExperts experts2;
  // Qwen3.5: a linear-attention layer (qkv and o are its in_proj and out_proj), or attention with an output gate.
  bool linear = false;
  int64_t gate = 0;  // the gates' width (heads x head_dim), after q | k | v in the qkv linear's rows; 0: none
  at::Tensor taps, a_log, dt_bias, ssm_norm;
  int64_t hk = 0, dk = 0, dv = 0, hv = 0, conv_k = 0, channels = 0;
  bool tiled = false;
  // Qwen3.5-MoE: a shared expert beside the routed ones (width `shared`; 0: none), scaled by sigmoid(gate . h).
  int64_t shared = 0;
  Linear shared_gate_up, shared_down;
  at::Tensor shared_gate;
};

Experts make_experts(const std::vector<at::Tensor>& t, int64_t at, const int64_t* z, int64_t hidden) {
  Experts x;
  x.w13_codes = t[at].contiguous(), x.w13_scales = t[at + 1].contiguous(), x.router = t[at + 2].contiguous();
  x.w2_codes = t[at + 4].contiguous(), x.w2_scales = t[at + 5].contiguous();
  TORCH_CHECK(x.w2_codes.dim() == 4, "DecoderStep: w2 codes [E, NBLK, KB, CB] expected");
  const int64_t inter = x.w2_codes.size(2) * 32;
  x.w13 = w4a8_stack(x.w13_codes, x.w13_scales, 2 * inter, z[6], "DecoderStep: w13");
  x.w2 = w4a8_stack(x.w2_codes, x.w2_scales, hidden, z[8], "DecoderStep: w2");
  TORCH_CHECK(x.w13.E == x.w2.E && x.w13.KB * 32 == hidden, "DecoderStep: expert stacks of another shape");
  TORCH_CHECK(x.router.scalar_type() == at::kFloat && x.router.dim() == 2 && x.router.size(0) == x.w13.E &&
              x.router.size(1) == hidden, "DecoderStep: a float32 router [E, hidden] expected");
  x.top_k = z[9], x.renormalize = z[10] != 0;
  TORCH_CHECK(x.top_k >= 1 && x.top_k <= x.w13.E, "DecoderStep: top_k in 1..E");
  return x;
}

// fn(t) for each row t < T, rows split over threads as the eager ops split them (about 32 K floats of
// work a piece; `width` floats a row): each row is computed alone, so the split changes no result.
template <class Fn>
void rows(int64_t T, int64_t width, const Fn& fn) {
  if (T == 1) return fn(0);  // a decode row: no loop to split
  parallel_for(0, T, std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) fn(t);
  });
}

// Writes T rows' keys and values (float32, row t's at qkv + t * QKV + QS and + QS + KS, KS floats each) into
// their slots of a cache of element type C (unless `write` is false: a layer reading another's cache), then runs
// the decode attention of the rows over it.
template <typename C>
void write_and_attend(const at::Tensor& cache, const float* qkv, int64_t T, int64_t QS, int64_t KS, int64_t QKV,
                      const int64_t* slots, const at::Tensor& tables, const at::Tensor& lens, int64_t H, int64_t KVH,
                      int64_t D, float scale, int64_t window, float* out, bool write = true) {
  C* kc = cache.data_ptr<C>();
  C* vc = kc + cache.size(1) * cache.size(2) * KS;
  for (int64_t t = 0; write && t < T; ++t) {  // std::copy converts: c10's float -> 16-bit rounds to nearest even
    const float* row = qkv + t * QKV;
    std::copy(row + QS, row + QS + KS, kc + slots[t] * KS);
    std::copy(row + QS + KS, row + QKV, vc + slots[t] * KS);
  }
  decode_attention_rows(qkv, QKV, kc, vc, tables.data_ptr<int64_t>(), tables.size(1), lens.data_ptr<int64_t>(), T, H,
                        KVH, D, cache.size(2), scale, window, out, QS);
}

// One plan's tensors, as the kernels read them.
struct Tables {
  at::Tensor slots, tables, lens;
  Tables(const at::Tensor& s, const at::Tensor& t, const at::Tensor& l, int64_t T)
      : slots(s.to(at::kLong).contiguous()), tables(t.to(at::kLong).contiguous()), lens(l.to(at::kLong).contiguous()) {
    TORCH_CHECK(slots.numel() == T && lens.numel() == T && tables.dim() == 2 && tables.size(0) == T,
                "DecoderStep: slot_mapping [T], block_tables [T, max_blocks], seq_lens [T]");
  }
};

}  // namespace

class DecoderStep : public torch::CustomClassHolder {
 public:
  DecoderStep(std::vector<at::Tensor> tensors, std::vector<int64_t> ints, double eps) : eps_(static_cast<float>(eps)) {
    TORCH_CHECK(ints.size() >= kHeaderInts,
                "DecoderStep: ints = hidden, heads, kv_heads, head_dim, intermediate, gelu, P, ...");
    hidden_ = ints[0], heads_ = ints[1], kv_heads_ = ints[2], head_dim_ = ints[3], inter_ = ints[4];
    gelu_ = ints[5] != 0, ple_ = ints[6];
    const int64_t layers = static_cast<int64_t>(tensors.size() - 1) / kTensorsPerLayer;
    TORCH_CHECK(static_cast<int64_t>(tensors.size()) == layers * kTensorsPerLayer + 1 &&
                static_cast<int64_t>(ints.size()) == kHeaderInts + kIntsPerLayer * layers, "DecoderStep: ", layers,
                " layers need ", layers * kTensorsPerLayer + 1, " tensors and ", kHeaderInts + kIntsPerLayer * layers,
                " ints");
    auto norm = [&](const at::Tensor& w, int64_t size, bool required) {
      if (!required && w.numel() == 0) return at::Tensor();
      TORCH_CHECK(w.scalar_type() == at::kFloat && w.numel() == size, "DecoderStep: float32 norm weights [", size, "]");
      return w.contiguous();
    };
    for (int64_t i = 0; i < layers; ++i) {
      const auto& t = tensors;
      const int64_t at = i * kTensorsPerLayer;
      const int64_t* z = ints.data() + kHeaderInts + kIntsPerLayer * i;
      const int64_t D = z[11], KVH = z[12], I = z[13], projections = z[14];
      TORCH_CHECK(D > 0 && D % 2 == 0 && KVH > 0 && heads_ % KVH == 0 && I > 0 && projections >= 0 &&
                  projections <= 2 && z[15] >= 0 && z[15] <= i && (projections == 0) == (z[15] != i),
                  "DecoderStep: layer ", i, ": heads a multiple of kv_heads, even head_dim, a source layer before it");
      const int64_t q = heads_ * D, kv = KVH * D;
      const bool linear = z[25] != 0;
      const int64_t gate = z[26] ? q : 0;
      // A linear-attention layer: its in_proj and out_proj in the qkv and o places.
      int64_t qkv_n = q + projections * kv + gate, o_k = q, hv = 0, channels = 0;
      if (linear) {
        hv = t[at + 43].numel();
        channels = t[at + 42].dim() == 2 ? t[at + 42].size(1) : 0;
        TORCH_CHECK(channels > 0 && z[27] > 0 && z[28] > 0 && z[29] > 0 && hv % z[27] == 0 &&
                    channels == 2 * z[27] * z[28] + hv * z[29], "DecoderStep: layer ", i, ": linear attention's taps "
                    "[K, C], C = 2 Hk Dk + Hv Dv");
        qkv_n = channels + hv * z[29] + 2 * hv, o_k = hv * z[29];
      }
      Layer layer{norm(t[at], hidden_, true), norm(t[at + 1], hidden_, true), norm(t[at + 2], hidden_, false),
                  norm(t[at + 3], hidden_, false), norm(t[at + 4], D, false), norm(t[at + 5], D, false),
                  make_linear(t, at + 6, z[1], z[2], qkv_n, hidden_),
                  make_linear(t, at + 10, z[3], z[4], hidden_, o_k), Linear{}, Linear{}, z[0] != 0};
      layer.linear = linear, layer.gate = gate;
      if (linear) {
        layer.taps = t[at + 42].contiguous(), layer.conv_k = t[at + 42].size(0), layer.channels = channels;
        layer.hk = z[27], layer.dk = z[28], layer.dv = z[29], layer.hv = hv, layer.tiled = z[30] != 0;
        layer.a_log = norm(t[at + 43], hv, true), layer.dt_bias = norm(t[at + 44], hv, true);
        layer.ssm_norm = norm(t[at + 45], layer.dv, true);
        TORCH_CHECK(layer.taps.scalar_type() == at::kFloat && layer.conv_k >= 2, "DecoderStep: float32 taps, K >= 2");
        max_qs_ = std::max(max_qs_, o_k);
      }
      if (linear || gate) max_proj_ = std::max(max_proj_, qkv_n);
      layer.moe = z[5] == 2;
      TORCH_CHECK(layer.moe == (z[7] == 2), "DecoderStep: a MoE layer's gate_up and down are both kind 2");
      if (layer.moe) {
        layer.experts = make_experts(t, at + 14, z, hidden_);
      } else {
        layer.gate_up = make_linear(t, at + 14, z[5], z[6], 2 * I, hidden_);
        layer.down = make_linear(t, at + 18, z[7], z[8], hidden_, I);
      }
      layer.shared = z[31];
      if (layer.shared) {
        TORCH_CHECK(layer.moe, "DecoderStep: layer ", i, ": a shared expert beside routed ones only");
        layer.shared_gate_up = make_linear(t, at + 46, z[32], z[33], 2 * layer.shared, hidden_);
        layer.shared_down = make_linear(t, at + 50, z[34], z[35], hidden_, layer.shared);
        layer.shared_gate = t[at + 54].contiguous();
        TORCH_CHECK(layer.shared_gate.scalar_type() == at::kFloat && layer.shared_gate.dim() == 2 &&
                    layer.shared_gate.size(0) == 1 && layer.shared_gate.size(1) == hidden_,
                    "DecoderStep: the shared expert's gate [1, hidden] float32");
        max_i_ = std::max(max_i_, layer.shared);
      }
      layer.head_dim = D, layer.kv_heads = KVH, layer.inter = I, layer.projections = projections;
      layer.source = z[15], layer.value_norm = z[16] != 0;
      layer.scalar = norm(t[at + 22], 1, false);
      if (ple_) {
        layer.ple_gate = make_linear(t, at + 23, z[17], z[18], ple_, hidden_);
        layer.ple_proj = make_linear(t, at + 27, z[19], z[20], hidden_, ple_);
        layer.ple_norm = norm(t[at + 31], hidden_, true);
      }
      layer.beside = z[21] != 0;
      if (layer.beside) {
        BesideExperts& x = layer.experts2;
        x.proj = t[at + 32].contiguous(), x.scale = norm(t[at + 33], hidden_, true);
        x.w13_codes = t[at + 35].contiguous(), x.w13_scales = t[at + 36].contiguous();
        x.w2_codes = t[at + 37].contiguous(), x.w2_scales = t[at + 38].contiguous();
        TORCH_CHECK(x.w2_codes.dim() == 4, "DecoderStep: w2 codes [E, NBLK, KB, CB] expected");
        const int64_t inter = x.w2_codes.size(2) * 32;
        x.w13 = w4a8_stack(x.w13_codes, x.w13_scales, 2 * inter, z[23], "DecoderStep: w13");
        x.w2 = w4a8_stack(x.w2_codes, x.w2_scales, hidden_, z[24], "DecoderStep: w2");
        x.per_expert_scale = norm(t[at + 34], x.w13.E, true);
        TORCH_CHECK(x.w13.E == x.w2.E && x.w13.KB * 32 == hidden_ && x.proj.scalar_type() == at::kFloat &&
                    x.proj.dim() == 2 && x.proj.size(0) == x.w13.E && x.proj.size(1) == hidden_,
                    "DecoderStep: Gemma 4's router [E, hidden] float32 and expert stacks of its E");
        x.input_norm = norm(t[at + 39], hidden_, true), x.mlp_norm = norm(t[at + 40], hidden_, true);
        x.experts_norm = norm(t[at + 41], hidden_, true);
        x.top_k = z[22];
        TORCH_CHECK(x.top_k >= 1 && x.top_k <= x.w13.E, "DecoderStep: top_k in 1..E");
      }
      TORCH_CHECK(layer.pre_feedforward_norm.defined() == layer.post_feedforward_norm.defined() &&
                  (!layer.k_norm.defined() || layer.q_norm.defined()) && (!ple_ || layer.scalar.defined()),
                  "DecoderStep: sandwich norms in pairs, a k norm beside a q norm, per-layer inputs with a scalar");
      max_qs_ = std::max(max_qs_, q), max_qkv_ = std::max(max_qkv_, q + 2 * kv), max_i_ = std::max(max_i_, I);
      max_d_ = std::max(max_d_, D);
      layers_.push_back(std::move(layer));
    }
    final_norm_ = norm(tensors.back(), hidden_, true);
    ones_.assign(max_d_, 1.f);
  }

  at::Tensor forward(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                     const at::Tensor& local_cos_in, const at::Tensor& local_sin_in,
                     const std::vector<at::Tensor>& kv_caches, const at::Tensor& slots, const at::Tensor& tables,
                     const at::Tensor& lens, const at::Tensor& local_slots, const at::Tensor& local_tables,
                     const at::Tensor& local_lens, double scale, int64_t window, const at::Tensor& lora_slots,
                     const at::Tensor& per_layer_inputs, const at::Tensor& q_scale, const at::Tensor& state_slots) {
    const int64_t H = hidden_;
    TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == H && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
                "DecoderStep: x [T, ", H, "] float32 on the CPU");
    const int64_t T = x_in.size(0);
    const int64_t L = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == L, "DecoderStep: one KV cache per layer");
    auto cache_type = at::kFloat;  // the attention layers' caches' (the linear-attention pools are float32)
    for (int64_t i = 0; i < L && i < static_cast<int64_t>(kv_caches.size()); ++i)
      if (!layers_[i].linear) {
        cache_type = kv_caches[i].scalar_type();
        break;
      }
    TORCH_CHECK(cache_type == at::kFloat || cache_type == at::kBFloat16 || cache_type == at::kHalf,
                "DecoderStep: a float32, bfloat16 or float16 KV cache");
    const auto x = x_in.contiguous();
    // The rotations' widths: the full layers' head size and the windowed ones' (Gemma 4's differ).
    int64_t full_half = 0, local_half = 0;
    for (const auto& layer : layers_) (layer.windowed ? local_half : full_half) = layer.head_dim / 2;
    std::vector<at::Tensor> rotary;
    for (const auto* c : {&cos_in, &sin_in, &local_cos_in, &local_sin_in}) {
      rotary.push_back(c->contiguous());
      const int64_t half = rotary.size() <= 2 ? full_half : local_half;
      TORCH_CHECK(rotary.back().scalar_type() == at::kFloat && (half == 0 || rotary.back().numel() == T * half),
                  "DecoderStep: cos, sin [T, head_dim / 2] float32 of each kind of layer");
    }
    const Tables full(slots, tables, lens, T), local(local_slots, local_tables, local_lens, T);
    const int64_t* lora_rows = nullptr;  // each row's LoRA slot (-1: none), or no LoRA this step
    if (lora_slots.numel()) {
      TORCH_CHECK(lora_slots.scalar_type() == at::kLong && lora_slots.dim() == 1 && lora_slots.size(0) == T &&
                  lora_slots.is_contiguous(), "DecoderStep: lora_slots [T] int64 contiguous");
      lora_rows = lora_slots.data_ptr<int64_t>();
    }
    const float* qs = nullptr;  // [T], or none
    if (q_scale.numel()) {
      TORCH_CHECK(q_scale.scalar_type() == at::kFloat && q_scale.is_contiguous() && q_scale.numel() == T,
                  "DecoderStep: q_scale [T] float32 contiguous");
      qs = q_scale.data_ptr<float>();
    }
    const float* ple = nullptr;  // [T, L, P]
    if (ple_) {
      TORCH_CHECK(per_layer_inputs.scalar_type() == at::kFloat && per_layer_inputs.is_contiguous() &&
                  per_layer_inputs.numel() == T * L * ple_, "DecoderStep: per_layer_inputs [T, ", L, ", ", ple_,
                  "] float32 contiguous");
      ple = per_layer_inputs.data_ptr<float>();
    }
    const int64_t* states = nullptr;  // [T]: each row's state slot in the linear-attention layers' pools
    if (state_slots.numel()) {
      TORCH_CHECK(state_slots.scalar_type() == at::kLong && state_slots.dim() == 1 && state_slots.size(0) == T &&
                  state_slots.is_contiguous(), "DecoderStep: state_slots [T] int64 contiguous");
      states = state_slots.data_ptr<int64_t>();
    }
    for (int64_t i = 0; i < L; ++i) {
      const auto& c = kv_caches[i];
      const Layer& layer = layers_[i];
      if (layer.linear) {  // its state pool
        TORCH_CHECK(states && c.dim() == 2 && c.scalar_type() == at::kFloat && c.is_contiguous() &&
                    c.size(1) == (layer.conv_k - 1) * layer.channels + layer.hv * layer.dk * layer.dv,
                    "DecoderStep: layer ", i, "'s state pool [S, (K - 1) C + Hv Dk Dv] float32 and state_slots");
        for (int64_t t = 0; t < T; ++t)
          TORCH_CHECK(states[t] >= 0 && states[t] < c.size(0), "DecoderStep: state slot ", states[t], " outside ",
                      c.size(0));
        continue;
      }
      TORCH_CHECK(c.dim() == 5 && c.size(0) == 2 && c.size(3) == layer.kv_heads && c.size(4) == layer.head_dim &&
                  c.scalar_type() == cache_type && c.is_contiguous(), "DecoderStep: layer ", i, "'s kv cache [2, "
                  "blocks, block_size, ", layer.kv_heads, ", ", layer.head_dim, "] contiguous, all of one dtype");
      TORCH_CHECK(layer.projections || c.data_ptr() == kv_caches[layer.source].data_ptr(),
                  "DecoderStep: layer ", i, " reads layer ", layer.source, "'s cache: the same tensor");
      const int64_t* sp = (layer.windowed ? local : full).slots.data_ptr<int64_t>();
      for (int64_t t = 0; t < T; ++t)
        TORCH_CHECK(sp[t] >= 0 && sp[t] < c.size(1) * c.size(2), "DecoderStep: slot ", sp[t], " outside layer ", i,
                    "'s cache");
      TORCH_CHECK(layer.input_norm.scalar_type() == at::kFloat, "DecoderStep: the model's norms are no longer float32");
    }

    residual_.resize(T * H), h_.resize(T * H), y_.resize(T * H);
    qkv_.resize(T * max_qkv_), attn_.resize(T * max_qs_), gate_up_.resize(T * 2 * max_i_), act_.resize(T * max_i_);
    if (ple_) ple_gate_.resize(T * 2 * ple_), ple_act_.resize(T * ple_);
    if (max_proj_) projected_.resize(std::max<int64_t>(projected_.size(), T * max_proj_));
    float* res = residual_.data();
    float* h = h_.data();
    float* y = y_.data();  // a sublayer's output, before it joins the residual stream
    float* qkv = qkv_.data();
    auto data = [](const at::Tensor& t) { return t.data_ptr<float>(); };
    std::copy(x.data_ptr<float>(), x.data_ptr<float>() + T * H, y);  // the embeddings: layer 0's residual
    for (int64_t i = 0; i < L; ++i) {
      const Layer& layer = layers_[i];
      const int64_t D = layer.head_dim, half = D / 2, KVH = layer.kv_heads, QS = heads_ * D, KS = KVH * D;
      const int64_t QKV = QS + 2 * KS, I = layer.inter, P = layer.projections;
      const Tables& plan = layer.windowed ? local : full;
      const float* cp = data(rotary[layer.windowed ? 2 : 0]);
      const float* snp = data(rotary[layer.windowed ? 3 : 1]);
      Clock clock(profiling_ ? profile_.data() : nullptr);
      rows(T, H, [&](int64_t t) {  // residual += y (layer 0: residual = x), h = input_layernorm(residual)
        if (i == 0) {
          std::copy(y + t * H, y + (t + 1) * H, res + t * H);
          rms_norm_row(res + t * H, data(layer.input_norm), eps_, H, h + t * H);
        } else {
          add_rms_norm_row(y + t * H, res + t * H, data(layer.input_norm), eps_, H, res + t * H, h + t * H);
        }
      });
      clock.lap(kNorms);
      if (layer.linear) {  // Qwen3.5's gated delta rule: in_proj, the state update (gated_delta.cpp), out_proj
        layer.qkv.run(h, T, projected_.data(), s4_, s8_, lora_rows, base_);
        clock.lap(kQkv);
        gated_delta_rows(projected_.data(), T, layer.qkv.n, kv_caches[i].data_ptr<float>(), kv_caches[i].size(1),
                         states, layer.taps.data_ptr<float>(), layer.conv_k, layer.channels,
                         layer.a_log.data_ptr<float>(), layer.dt_bias.data_ptr<float>(),
                         layer.ssm_norm.data_ptr<float>(), layer.hk, layer.dk, layer.dv, layer.hv, layer.tiled, eps_,
                         attn_.data());
        clock.lap(kAttention);
        layer.o.run(attn_.data(), T, y, s4_, s8_, lora_rows, base_);
        clock.lap(kO);
      } else {  // attention
        const int64_t G = layer.gate, W = QS + P * KS + G;  // the qkv linear's row: q | k | v | gates
        if (P == 2 && !G) {  // q | k | v rows, as the attention reads them
          layer.qkv.run(h, T, qkv, s4_, s8_, lora_rows, base_);
        } else {  // q | k (values: the keys' projection, copied before the keys' norm) or q alone; gates kept apart
          projected_.resize(std::max<int64_t>(projected_.size(), T * W));
          layer.qkv.run(h, T, projected_.data(), s4_, s8_, lora_rows, base_);
          for (int64_t t = 0; t < T; ++t) {
            const float* src = projected_.data() + t * W;
            std::copy(src, src + QS + P * KS, qkv + t * QKV);
            if (P == 1) std::copy(src + QS, src + QS + KS, qkv + t * QKV + QS + KS);
          }
        }
        clock.lap(kQkv);
        if (layer.q_norm.defined() || layer.value_norm) {  // each head normalised before its rotation, in place
          rows(T, QS + 2 * KS, [&](int64_t t) {
            float* row = qkv + t * QKV;
            if (layer.q_norm.defined())
              for (int64_t j = 0; j < heads_; ++j) rms_norm_row(row + j * D, data(layer.q_norm), eps_, D, row + j * D);
            if (layer.k_norm.defined() && P)
              for (int64_t j = 0; j < KVH; ++j)
                rms_norm_row(row + QS + j * D, data(layer.k_norm), eps_, D, row + QS + j * D);
            if (layer.value_norm && P)
              for (int64_t j = 0; j < KVH; ++j)
                rms_norm_row(row + QS + KS + j * D, ones_.data(), eps_, D, row + QS + KS + j * D);
          });
          clock.lap(kNorms);
        }
        rows(T, QS + KS, [&](int64_t t) {
          rotate_rows(qkv + t * QKV, 1, heads_, QKV, D, cp + t * half, snp + t * half, half);
          if (P) rotate_rows(qkv + t * QKV + QS, 1, KVH, QKV, D, cp + t * half, snp + t * half, half);
          if (qs)  // the eager layers' q * q_scale, the same float32 products
            for (float *q = qkv + t * QKV, *end = q + QS; q < end; ++q) *q *= qs[t];
        });
        clock.lap(kRotary);
        const int64_t* sp = plan.slots.data_ptr<int64_t>();
        const float sc = static_cast<float>(scale);
        const int64_t w = layer.windowed ? window : 0;
        const at::Tensor& cache = kv_caches[i];  // a layer without keys of its own reads its source's (the same)
        if (cache_type == at::kFloat)
          write_and_attend<float>(cache, qkv, T, QS, KS, QKV, sp, plan.tables, plan.lens, heads_, KVH, D, sc, w,
                                  attn_.data(), P != 0);
        else if (cache_type == at::kBFloat16)
          write_and_attend<c10::BFloat16>(cache, qkv, T, QS, KS, QKV, sp, plan.tables, plan.lens, heads_, KVH, D, sc,
                                          w, attn_.data(), P != 0);
        else
          write_and_attend<c10::Half>(cache, qkv, T, QS, KS, QKV, sp, plan.tables, plan.lens, heads_, KVH, D, sc, w,
                                      attn_.data(), P != 0);
        if (G)  // Qwen3.5: each head's output times the sigmoid of its gates, as the eager attention's sigmoid_gate
          sigmoid_gate_rows(attn_.data(), projected_.data() + QS + P * KS, T, QS, W);
        clock.lap(kAttention);
        layer.o.run(attn_.data(), T, y, s4_, s8_, lora_rows, base_);
        clock.lap(kO);
      }
      rows(T, H, [&](int64_t t) {
        if (layer.pre_feedforward_norm.defined()) {  // Gemma: the output normed, then added and normed again
          rms_norm_row(y + t * H, data(layer.post_attention_norm), eps_, H, y + t * H);
          add_rms_norm_row(y + t * H, res + t * H, data(layer.pre_feedforward_norm), eps_, H, res + t * H, h + t * H);
        } else {
          add_rms_norm_row(y + t * H, res + t * H, data(layer.post_attention_norm), eps_, H, res + t * H, h + t * H);
        }
      });
      clock.lap(kNorms);
      if (layer.moe) {
        run_experts(layer.experts, h, T, y);
        clock.lap(kExperts);
        if (layer.shared) {  // y = y + sigmoid(gate . h) * shared(h), by the ATen calls the eager layer makes
          layer.shared_gate_up.run(h, T, gate_up_.data(), s4_, s8_, lora_rows, base_);
          silu_and_mul_rows(gate_up_.data(), T, layer.shared, act_.data());
          auto shared = at::empty({T, H}, at::kFloat);
          layer.shared_down.run(act_.data(), T, shared.data_ptr<float>(), s4_, s8_, lora_rows, base_);
          const auto h_rows = at::from_blob(h, {T, H}, at::kFloat), y_rows = at::from_blob(y, {T, H}, at::kFloat);
          y_rows.copy_(at::add(y_rows, at::mul(at::sigmoid(at::linear(h_rows, layer.shared_gate)), shared)));
          clock.lap(kExperts);
        }
      } else {
        layer.gate_up.run(h, T, gate_up_.data(), s4_, s8_, lora_rows, base_);
        clock.lap(kGateUp);
        rows(T, I, [&](int64_t t) {
          (gelu_ ? gelu_tanh_and_mul_rows : silu_and_mul_rows)(gate_up_.data() + t * 2 * I, 1, I, act_.data() + t * I);
        });
        clock.lap(kAct);
        layer.down.run(act_.data(), T, y, s4_, s8_, lora_rows, base_);
        clock.lap(kDown);
      }
      if (layer.beside) {  // Gemma 4's experts: y = mlp_norm(y) + experts_norm(experts(input_norm(res)))
        run_beside_experts(layer.experts2, res, T, y);
        clock.lap(kExperts);
      }
      if (layer.post_feedforward_norm.defined()) {
        rows(T, H, [&](int64_t t) { rms_norm_row(y + t * H, data(layer.post_feedforward_norm), eps_, H, y + t * H); });
        clock.lap(kNorms);
      }
      if (layer.scalar.defined()) {  // Gemma 4: the stream made whole here, its per-layer input added, scaled
        gemma4_tail(layer, i, T, ple, res, y);
        clock.lap(kNorms);
      }
    }
    Clock clock(profiling_ ? profile_.data() : nullptr);
    auto out = at::empty({T, H}, x.options());
    float* op = out.data_ptr<float>();
    rows(T, H, [&](int64_t t) {
      add_rms_norm_row(y + t * H, res + t * H, data(final_norm_), eps_, H, res + t * H, op + t * H);
    });
    clock.lap(kNorms);
    return out;
  }

  // Gemma 4's experts beside the MLP, as model/moe.py's Gemma4Router and W4A8Gemma4Experts and the eager layer
  // compute them: the routing by the same ATen calls on a copy of the residual stream `res` (unit RMS in float32,
  // times scale and hidden^-0.5, the router, softmax, top k, renormalised, times each expert's scale), the
  // experts (GeGLU) on input_norm(res), and y = mlp_norm(y) + experts_norm(experts).
  void run_beside_experts(const BesideExperts& x, const float* res, int64_t T, float* y) {
    const int64_t H = hidden_;
    auto stream = at::empty({T, H}, at::kFloat);
    std::copy(res, res + T * H, stream.data_ptr<float>());
    const auto normed = stream * at::rsqrt(stream.pow(2).mean(-1, true) + eps_);
    const auto logits = at::linear(normed * x.scale * std::pow(static_cast<double>(H), -0.5), x.proj);
    auto [weights, chosen] = at::topk(at::softmax(logits.to(at::kFloat), -1), x.top_k, -1);
    weights = weights / weights.sum(-1, true);
    weights = (weights * x.per_expert_scale.index({chosen})).contiguous(), chosen = chosen.contiguous();
    experts_in_.resize(T * H), experts_out_.resize(T * H);
    rows(T, H, [&](int64_t t) {
      rms_norm_row(res + t * H, x.input_norm.data_ptr<float>(), eps_, H, experts_in_.data() + t * H);
    });
    w4a8_experts_rows(experts_in_.data(), T, H, weights.data_ptr<float>(), chosen.data_ptr<int64_t>(), x.top_k, x.w13,
                      x.w2, 0, experts_out_.data(), s4_, true);
    rows(T, H, [&](int64_t t) {
      rms_norm_row(y + t * H, x.mlp_norm.data_ptr<float>(), eps_, H, y + t * H);
      float* e = experts_out_.data() + t * H;
      rms_norm_row(e, x.experts_norm.data_ptr<float>(), eps_, H, e);
      for (int64_t d = 0; d < H; ++d) y[t * H + d] = y[t * H + d] + e[d];
    });
  }

  // The end of a Gemma 4 layer, as model/llama.py's DecoderLayer ends it: res = res + y; with per-layer inputs
  // res += norm(proj(gelu_tanh(gate(res)) * input)); res *= the layer's scalar; y = 0 (the next layer's
  // residual add then adds nothing: its norm sees res exactly).
  void gemma4_tail(const Layer& layer, int64_t i, int64_t T, const float* ple, float* res, float* y) {
    const int64_t H = hidden_, L = static_cast<int64_t>(layers_.size());
    for (int64_t j = 0; j < T * H; ++j) res[j] = res[j] + y[j];
    if (ple) {
      // [gate | input] rows for the gated activation, as the eager layer concatenates them
      layer.ple_gate.run(res, T, ple_act_.data(), s4_, s8_, nullptr, base_);
      for (int64_t t = 0; t < T; ++t) {
        std::copy(ple_act_.data() + t * ple_, ple_act_.data() + (t + 1) * ple_, ple_gate_.data() + t * 2 * ple_);
        const float* input = ple + (t * L + i) * ple_;
        std::copy(input, input + ple_, ple_gate_.data() + t * 2 * ple_ + ple_);
      }
      gelu_tanh_and_mul_rows(ple_gate_.data(), T, ple_, ple_act_.data());
      layer.ple_proj.run(ple_act_.data(), T, y, s4_, s8_, nullptr, base_);
      rows(T, H, [&](int64_t t) {
        rms_norm_row(y + t * H, layer.ple_norm.data_ptr<float>(), eps_, H, y + t * H);
        for (int64_t d = 0; d < H; ++d) res[t * H + d] = res[t * H + d] + y[t * H + d];
      });
    }
    const float scalar = layer.scalar.data_ptr<float>()[0];
    for (int64_t j = 0; j < T * H; ++j) res[j] = res[j] * scalar;
    std::fill(y, y + T * H, 0.f);
  }

  // y [T, H] = the MoE block of rows h [T, H]: the router and the routing by the ATen calls the eager block
  // makes (kernels/moe.py `route`: softmax in float32, top k, renormalised), on a copy of h in a tensor of
  // torch's own (the GEMM's path may depend on alignment), then the experts (w4a8_experts_rows).
  void run_experts(const Experts& x, const float* h, int64_t T, float* y) {
    auto rows_in = at::empty({T, hidden_}, at::kFloat);
    std::copy(h, h + T * hidden_, rows_in.data_ptr<float>());
    const auto probs = at::softmax(at::linear(rows_in, x.router), -1);
    auto [weights, chosen] = at::topk(probs, x.top_k, -1);
    if (x.renormalize) weights = weights / weights.sum(-1, true);
    weights = weights.contiguous(), chosen = chosen.contiguous();
    w4a8_experts_rows(h, T, hidden_, weights.data_ptr<float>(), chosen.data_ptr<int64_t>(), x.top_k, x.w13, x.w2, 0, y,
                      s4_);
  }

  // LoRA slots on layer `layer`'s linear `which` (0 qkv, 1 o, 2 gate_up, 3 down), the eager wrapper's tensors
  // (model/lora_slots.py) held as they are, so an adapter loaded into a slot later is read: a [S, R, K] and b
  // [S, R, N] float32 contiguous, splits its parts' column bounds (empty: one part).
  void set_lora(int64_t layer, int64_t which, at::Tensor a, at::Tensor b, std::vector<int64_t> splits) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()) && which >= 0 && which < 4,
                "DecoderStep: set_lora of layer ", layer, ", linear ", which);
    Layer& l = layers_[layer];
    TORCH_CHECK(!(l.moe && which >= 2), "DecoderStep: a mixture-of-experts layer's MLP takes no LoRA");
    Linear& linear = which == 0 ? l.qkv : which == 1 ? l.o : which == 2 ? l.gate_up : l.down;
    for (const auto* t : {&a, &b})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->is_contiguous() && t->device().is_cpu(),
                  "DecoderStep: LoRA a [S, R, K] and b [S, R, N] float32 contiguous");
    TORCH_CHECK(a.size(0) == b.size(0) && a.size(1) == b.size(1) && a.size(2) == linear.k && b.size(2) == linear.n,
                "DecoderStep: LoRA a [S, R, ", linear.k, "] and b [S, R, ", linear.n, "] expected");
    linear.lora_bounds = lora_bounds(splits, linear.n, a.size(1));
    linear.lora_a = a, linear.lora_b = b;
  }

  // Time each part of the steps from now on (on: a clock read between parts, about 20 ns each), or stop.
  void set_profiling(bool on) { profiling_ = on; }

  // Seconds in each part (norms, qkv, rotary, attention with the cache write, o, gate_up, the gated
  // activation, down, a MoE layer's router and experts) over the steps since the last call, which starts the
  // count again.
  std::vector<double> take_profile() {
    std::vector<double> seconds(profile_.begin(), profile_.end());
    std::fill(profile_.begin(), profile_.end(), 0.0);
    return seconds;
  }

 private:
  // Adds the time since the last lap to a part's total; does nothing without totals (profiling off).
  struct Clock {
    explicit Clock(double* totals) : totals(totals), last(totals ? now() : 0.0) {}
    static double now() {
      return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
    }
    void lap(Part part) {
      if (!totals) return;
      const double t = now();
      totals[part] += t - last;
      last = t;
    }
    double* totals;
    double last;
  };

  float eps_;
  int64_t hidden_ = 0, heads_ = 0, kv_heads_ = 0, head_dim_ = 0, inter_ = 0, ple_ = 0;
  int64_t max_qs_ = 0, max_qkv_ = 0, max_i_ = 0, max_d_ = 0;  // the widest layer's, for the buffers
  int64_t max_proj_ = 0;  // a linear-attention layer's projection, or gated attention's q | k | v | gate
  bool gelu_ = false;
  std::vector<Layer> layers_;
  at::Tensor final_norm_;
  std::vector<float> ones_;  // a weight of ones: the values' norm has none
  // Kept from step to step (one step at a time per model: the engine's loop).
  std::vector<float> residual_, h_, y_, qkv_, attn_, gate_up_, act_, base_;  // base_: a linear's output before LoRA
  std::vector<float> projected_, ple_gate_, ple_act_;  // Gemma 4: a q/k projection, the per-layer gate and output
  std::vector<float> experts_in_, experts_out_;  // Gemma 4's experts beside the MLP: their input and output
  W4A8Scratch s4_;
  W8A8Scratch s8_;
  bool profiling_ = false;
  std::vector<double> profile_ = std::vector<double>(kParts, 0.0);
};

}  // namespace ladder

TORCH_LIBRARY_FRAGMENT(ladder_cpu, m) {
  m.class_<ladder::DecoderStep>("DecoderStep")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, double>())
      .def("forward", &ladder::DecoderStep::forward)
      .def("set_lora", &ladder::DecoderStep::set_lora)
      .def("set_profiling", &ladder::DecoderStep::set_profiling)
      .def("take_profile", &ladder::DecoderStep::take_profile);
}
