// The Llama decoder's layers as one C++ call, for float32 activations and W4A8 linears on the CPU: a step's
// rows go through every layer (norms, the four linears, the rotary embedding, the cache write, paged
// attention, SiLU x up) with no Python and no dispatcher between the kernels, into buffers kept from step
// to step. At batch 1 a decode step of a small model was a third Python and dispatch (about 600 calls of a
// few microseconds each); here it is one call.
//
// Each part runs the same function as its custom op (cpu_kernels.h), in the order the eager module calls
// them, so the hidden states equal the eager model's bit for bit (tests/kernels/test_decoder_step.py), and
// they keep its batch invariance: every row is computed alone.
//
// DecoderStep(tensors, ints, eps), built once per model (model/cpu_step.py):
//   tensors: per layer, in order, input_layernorm [hidden]; qkv codes, scales, bias; o codes, scales,
//            bias; post_attention_layernorm [hidden]; gate_up codes, scales, bias; down codes, scales, bias
//            (a bias is an empty tensor when the linear has none); then the final norm [hidden].
//   ints:    hidden, heads, kv_heads, head_dim, intermediate, then each layer's four linears' `zero`.
// forward(x [T, hidden], cos, sin [T, head_dim / 2], kv_caches (one [2, blocks, block_size, kv_heads,
//   head_dim] float32 per layer), slot_mapping [T], block_tables [T, max_blocks], seq_lens [T] (each row a
//   decode row: it sees seq_lens[t] keys, its own included), scale, window) -> final hidden [T, hidden].
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_kernels.h"

namespace ladder {
namespace {

constexpr int64_t kTensorsPerLayer = 14;

struct Linear {
  at::Tensor codes, scales, bias;  // bias: empty when none
  int64_t n = 0, zero = 0;

  W4A8Weight weight() const {
    return W4A8Weight{codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                      bias.numel() ? bias.data_ptr<float>() : nullptr, n, codes.size(1) * 32, codes.size(0),
                      static_cast<int>(scales.size(2)), codes.size(2) == 256, static_cast<int32_t>(zero)};
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;
  Linear qkv, o, gate_up, down;
};

Linear make_linear(const std::vector<at::Tensor>& t, int64_t at, int64_t n, int64_t k, int64_t zero) {
  Linear l{t[at].contiguous(), t[at + 1].contiguous(), t[at + 2].contiguous(), n, zero};
  TORCH_CHECK(l.codes.scalar_type() == at::kByte && l.codes.dim() == 3 &&
              (l.codes.size(2) == 256 || l.codes.size(2) == 512) && l.codes.size(1) * 32 == k &&
              l.codes.size(0) * 16 >= n, "DecoderStep: codes of a [", n, ", ", k, "] W4A8 linear expected");
  TORCH_CHECK(l.scales.scalar_type() == at::kHalf && l.scales.dim() == 4 && l.scales.size(0) == l.codes.size(0) &&
              l.scales.size(1) == l.codes.size(1) && l.scales.size(3) == 16, "DecoderStep: W4A8 scales expected");
  TORCH_CHECK(l.bias.numel() == 0 || (l.bias.scalar_type() == at::kFloat && l.bias.numel() == n),
              "DecoderStep: a bias of ", n, " floats expected");
  return l;
}

}  // namespace

class DecoderStep : public torch::CustomClassHolder {
 public:
  DecoderStep(std::vector<at::Tensor> tensors, std::vector<int64_t> ints, double eps) : eps_(static_cast<float>(eps)) {
    TORCH_CHECK(ints.size() >= 5, "DecoderStep: ints = hidden, heads, kv_heads, head_dim, intermediate, zeros");
    hidden_ = ints[0], heads_ = ints[1], kv_heads_ = ints[2], head_dim_ = ints[3], inter_ = ints[4];
    const int64_t layers = static_cast<int64_t>(tensors.size() - 1) / kTensorsPerLayer;
    TORCH_CHECK(static_cast<int64_t>(tensors.size()) == layers * kTensorsPerLayer + 1 &&
                static_cast<int64_t>(ints.size()) == 5 + 4 * layers, "DecoderStep: ", layers,
                " layers need ", layers * kTensorsPerLayer + 1, " tensors and ", 5 + 4 * layers, " ints");
    TORCH_CHECK(heads_ % kv_heads_ == 0 && head_dim_ % 2 == 0, "DecoderStep: heads a multiple of kv_heads, even head_dim");
    const int64_t q = heads_ * head_dim_, qkv = q + 2 * kv_heads_ * head_dim_;
    auto norm = [&](const at::Tensor& w) {
      TORCH_CHECK(w.scalar_type() == at::kFloat && w.numel() == hidden_, "DecoderStep: float32 norm weights [hidden]");
      return w.contiguous();
    };
    for (int64_t i = 0; i < layers; ++i) {
      const int64_t at = i * kTensorsPerLayer;
      const int64_t* z = ints.data() + 5 + 4 * i;
      layers_.push_back(Layer{norm(tensors[at]), norm(tensors[at + 7]),
                              make_linear(tensors, at + 1, qkv, hidden_, z[0]),
                              make_linear(tensors, at + 4, hidden_, q, z[1]),
                              make_linear(tensors, at + 8, 2 * inter_, hidden_, z[2]),
                              make_linear(tensors, at + 11, hidden_, inter_, z[3])});
    }
    final_norm_ = norm(tensors.back());
  }

  at::Tensor forward(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                     const std::vector<at::Tensor>& kv_caches, const at::Tensor& slots_in, const at::Tensor& tables_in,
                     const at::Tensor& lens_in, double scale, int64_t window) {
    const int64_t H = hidden_, D = head_dim_, half = D / 2, QS = heads_ * D, KS = kv_heads_ * D;
    const int64_t QKV = QS + 2 * KS, I = inter_;
    TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == H && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
                "DecoderStep: x [T, ", H, "] float32 on the CPU");
    const int64_t T = x_in.size(0);
    TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == static_cast<int64_t>(layers_.size()),
                "DecoderStep: one KV cache per layer");
    const auto x = x_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
    const auto slots = slots_in.to(at::kLong).contiguous(), tables = tables_in.to(at::kLong).contiguous();
    const auto lens = lens_in.to(at::kLong).contiguous();
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.numel() == T * half &&
                sin.numel() == T * half, "DecoderStep: cos, sin [T, head_dim / 2] float32");
    TORCH_CHECK(slots.numel() == T && lens.numel() == T && tables.dim() == 2 && tables.size(0) == T,
                "DecoderStep: slot_mapping [T], block_tables [T, max_blocks], seq_lens [T]");
    const auto& cache0 = kv_caches[0];
    TORCH_CHECK(cache0.dim() == 5 && cache0.size(0) == 2 && cache0.size(3) == kv_heads_ && cache0.size(4) == D,
                "DecoderStep: kv caches [2, blocks, block_size, ", kv_heads_, ", ", D, "]");
    const int64_t blocks = cache0.size(1), BS = cache0.size(2), max_blocks = tables.size(1);
    for (const auto& c : kv_caches)
      TORCH_CHECK(c.scalar_type() == at::kFloat && c.is_contiguous() && c.sizes() == cache0.sizes(),
                  "DecoderStep: float32 contiguous kv caches of one shape");
    const int64_t* sp = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t)
      TORCH_CHECK(sp[t] >= 0 && sp[t] < blocks * BS, "DecoderStep: slot ", sp[t], " outside the cache");
    for (const auto& layer : layers_)
      TORCH_CHECK(layer.input_norm.scalar_type() == at::kFloat && layer.post_norm.scalar_type() == at::kFloat,
                  "DecoderStep: the model's norms are no longer float32");

    residual_.resize(T * H), h_.resize(T * H), y_.resize(T * H);
    qkv_.resize(T * QKV), attn_.resize(T * QS), gate_up_.resize(T * 2 * I), act_.resize(T * I);
    float* res = residual_.data();
    float* h = h_.data();
    float* y = y_.data();  // a linear's output that joins the residual stream
    const float* cp = cos.data_ptr<float>();
    const float* snp = sin.data_ptr<float>();
    const int64_t* tp = tables.data_ptr<int64_t>();
    const int64_t* lp = lens.data_ptr<int64_t>();
    std::copy(x.data_ptr<float>(), x.data_ptr<float>() + T * H, y);  // the embeddings: layer 0's residual
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      float* cache = kv_caches[i].data_ptr<float>();
      float* kc = cache;
      float* vc = cache + blocks * BS * KS;
      // residual += y (layer 0: residual = x), h = input_layernorm(residual)
      for (int64_t t = 0; t < T; ++t) {
        if (i == 0) {
          std::copy(y + t * H, y + (t + 1) * H, res + t * H);
          rms_norm_row(res + t * H, layer.input_norm.data_ptr<float>(), eps_, H, h + t * H);
        } else {
          add_rms_norm_row(y + t * H, res + t * H, layer.input_norm.data_ptr<float>(), eps_, H, res + t * H, h + t * H);
        }
      }
      w4a8_rows(h, T, layer.qkv.weight(), qkv_.data(), scratch_, false);
      rotate_rows(qkv_.data(), T, heads_, QKV, D, cp, snp, half);
      rotate_rows(qkv_.data() + QS, T, kv_heads_, QKV, D, cp, snp, half);
      for (int64_t t = 0; t < T; ++t) {  // the step's keys and values into their slots
        const float* row = qkv_.data() + t * QKV;
        std::copy(row + QS, row + QS + KS, kc + sp[t] * KS);
        std::copy(row + QS + KS, row + QKV, vc + sp[t] * KS);
      }
      decode_attention_rows(qkv_.data(), QKV, kc, vc, tp, max_blocks, lp, T, heads_, kv_heads_, D, BS,
                            static_cast<float>(scale), window, attn_.data(), QS);
      w4a8_rows(attn_.data(), T, layer.o.weight(), y, scratch_, false);
      for (int64_t t = 0; t < T; ++t)
        add_rms_norm_row(y + t * H, res + t * H, layer.post_norm.data_ptr<float>(), eps_, H, res + t * H, h + t * H);
      w4a8_rows(h, T, layer.gate_up.weight(), gate_up_.data(), scratch_, false);
      silu_and_mul_rows(gate_up_.data(), T, I, act_.data());
      w4a8_rows(act_.data(), T, layer.down.weight(), y, scratch_, false);
    }
    auto out = at::empty({T, H}, x.options());
    float* op = out.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t)
      add_rms_norm_row(y + t * H, res + t * H, final_norm_.data_ptr<float>(), eps_, H, res + t * H, op + t * H);
    return out;
  }

 private:
  float eps_;
  int64_t hidden_ = 0, heads_ = 0, kv_heads_ = 0, head_dim_ = 0, inter_ = 0;
  std::vector<Layer> layers_;
  at::Tensor final_norm_;
  // Kept from step to step (one step at a time per model: the engine's loop).
  std::vector<float> residual_, h_, y_, qkv_, attn_, gate_up_, act_;
  W4A8Scratch scratch_;
};

}  // namespace ladder

TORCH_LIBRARY_FRAGMENT(ladder_cpu, m) {
  m.class_<ladder::DecoderStep>("DecoderStep")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, double>())
      .def("forward", &ladder::DecoderStep::forward);
}
