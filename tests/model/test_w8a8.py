"""W8A8 (int8 weights and per-token int8 activations) and the SmoothQuant folding it relies on.

The compiled artifact is covered with the other precisions in tests/compile/test_compile.py (tiny model) and
tests/compile/test_compile_default.py (perplexity bound on the default model).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from model import smoothquant as smooth
from model.sequences import Sequences
from model.quantization import W8A8Linear, apply_precision
from kernels.int8_matmul import quantize_int8_ref
from model.loader import load
from tiny_models import make_hf_model


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("w8a8")
    dirs = {}
    # qwen2: tied embeddings (smoothing unties the head) and q/k/v biases; gemma3: the MLP's input comes from
    # pre_feedforward_layernorm, the attention's output goes through post_attention_layernorm
    for family in ("llama3", "qwen2", "gemma3"):
        make_hf_model(family, root / family)
        dirs[family] = root / family
    return dirs


def test_linear_is_integer_matmul_of_per_token_quantized_rows():
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(96, 40, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 96, generator=gen))
        linear.bias.copy_(torch.randn(40, generator=gen))
    x = torch.randn(2, 5, 96, generator=gen) * torch.linspace(0.1, 10, 96)  # channels of very different sizes
    x[0, 1] = 0.0  # an all-zero row quantizes to zeros, not NaN
    module = W8A8Linear.from_linear(linear)
    y = module(x)
    # Reference in float64 from the same integers: each row's scale, then the exact integer products.
    w_q, w_scale = quantize_int8_ref(linear.weight)
    rows = x.reshape(-1, 96).double()
    x_scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    x_q = torch.round(rows / x_scale)
    ref = (x_q @ w_q.double().T) * x_scale * w_scale.double() + linear.bias.double()
    assert y.shape == (2, 5, 40) and y.dtype == torch.float32
    assert torch.allclose(y.reshape(-1, 40).double(), ref, rtol=1e-5, atol=1e-4)
    assert torch.equal(y[0, 1], linear.bias.detach())
    # and close to the float layer it stands for (int8 keeps about two decimal digits)
    assert ((y - linear(x)).norm() / linear(x).norm()).item() < 0.03


def test_rows_are_quantized_independently():
    """Each token's scale is its own: a row's output does not depend on what else is in the batch."""
    linear = nn.Linear(64, 32, bias=False)
    module = W8A8Linear.from_linear(linear)
    x = torch.randn(7, 64)
    alone = torch.cat([module(x[i:i + 1]) for i in range(7)])
    x_loud = torch.cat([x, 1000 * torch.randn(1, 64)])
    assert torch.equal(module(x), alone) and torch.equal(module(x_loud)[:7], alone)


def _logits(module, token_ids: list[list[int]]) -> torch.Tensor:
    seqs = Sequences(module, len(token_ids), 64)
    return seqs.step(token_ids, all_rows=True)


@pytest.mark.parametrize("family", ["llama3", "qwen2", "gemma3"])
def test_smoothing_leaves_the_float_model_unchanged(tiny_dirs, family):
    module = load(tiny_dirs[family]).module
    prompts = [[5, 9, 30, 31, 2], [7, 7, 8, 100, 250, 3, 4]]
    before = _logits(module, prompts)
    embedding = module.embed_tokens.weight.detach().clone()
    norm_before = module.layers[0].input_layernorm.weight.detach().clone()
    calibration = smooth.calibration_ids(None, module.config.vocab_size)
    alphas = smooth.smooth(module, calibration[:300])
    assert set(alphas) == {f"layers.{i}.{name}" for i in range(2) for name in
                           ("self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj")} | {"lm_head"}
    assert set(alphas.values()) <= set(smooth.ALPHAS)
    assert not torch.equal(module.layers[0].input_layernorm.weight, norm_before), "scales were folded"
    assert torch.equal(module.embed_tokens.weight, embedding), "the embedding lookup keeps its table"
    assert module.lm_head.weight is not module.embed_tokens.weight
    after = _logits(module, prompts)
    assert ((after - before).abs().max() / before.abs().max()).item() < 1e-4


def test_smoothing_evens_out_activation_channels(tiny_dirs):
    """What smoothing is for: after it, the largest channel of a linear's input is much closer to the rest."""
    module = load(tiny_dirs["llama3"]).module
    with torch.no_grad():  # an outlier channel, as RMSNorm weights produce in real models
        module.layers[0].input_layernorm.weight[3] *= 50
    calibration = smooth.calibration_ids(None, module.config.vocab_size)[:300]
    spread = lambda m: (lambda a: (a.max() / a.median()).item())(smooth.linear_inputs(m, calibration)[
        "layers.0.self_attn.qkv_proj"].absmax)
    before = spread(module)
    smooth.smooth(module, calibration)
    assert spread(module) < before / 4


def test_w8a8_model_tracks_fp32(tiny_dirs):
    module = load(tiny_dirs["llama3"]).module
    prompts = [[5, 9, 30, 31, 2, 17, 40], [7, 7, 8, 100, 250, 3, 4]]
    reference = _logits(module, prompts)
    smooth.smooth(module, smooth.calibration_ids(None, module.config.vocab_size)[:300])
    quantized = apply_precision(module, "w8a8")
    assert all(not isinstance(m, nn.Linear) for m in quantized.modules())
    logits = _logits(quantized, prompts)
    assert ((logits - reference).norm() / reference.norm()).item() < 0.05
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean().item() >= 0.8


# -- quantization at load (`model.load(..., quantization=...)`, `--quantization`) ----------------------------

def test_quantization_at_load_caches_the_calibration(tiny_dirs, tmp_path, monkeypatch):
    """w8a8 at load calibrates SmoothQuant once and reads the cached scales after; a damaged cache file is
    calibrated again, never trusted; the result is the same model each time."""
    from model import smoothquant

    monkeypatch.setenv("LADDER_CACHE_DIR", str(tmp_path))
    ids = [[5, 17, 33, 2, 9], [7, 7, 1]]

    def logits(loaded):
        from model.sequences import Sequences
        return Sequences(loaded.module, 2, 16).step(ids)

    first = load(tiny_dirs["qwen2"], quantization="w8a8")
    assert first.quantization == "w8a8"
    assert all(isinstance(m, W8A8Linear) for m in (first.module.lm_head, first.module.layers[0].mlp.down_proj))
    files = list((tmp_path / "smoothquant").glob("*.safetensors"))
    assert len(files) == 1
    stamp = files[0].stat().st_mtime_ns
    second = load(tiny_dirs["qwen2"], quantization="w8a8")
    assert files[0].stat().st_mtime_ns == stamp  # read, not rewritten
    assert torch.equal(logits(first), logits(second))
    files[0].write_bytes(b"not a safetensors file")
    third = load(tiny_dirs["qwen2"], quantization="w8a8")
    assert torch.equal(logits(first), logits(third))
    smoothing = smoothquant.read(files[0], "another key", third.module)
    assert smoothing is None  # a file made for other weights is not used
    weight_only = load(tiny_dirs["llama3"], quantization="int8")
    assert weight_only.quantization == "int8" and not list((tmp_path / "smoothquant").glob("*.tmp"))


def test_quantization_choices_and_errors(tiny_dirs, monkeypatch):
    from model import quantization
    from model.quantization import resolve_quantization

    # auto: the default GGUF's own blocks (W4A8) in one process, W8A8 where W4A8 does not apply (a Hugging
    # Face directory, tensor-parallel ranks), nothing for 16-bit weights, a GPU or a CPU whose int8 kernels
    # are portable loops (no AVX-512 VNNI).
    monkeypatch.setattr(quantization, "int8_kernels_are_fast", lambda: False)
    assert resolve_quantization("auto", "float32", "cpu") == "none"
    assert resolve_quantization("auto", "float32", "cpu", tiny_dirs["llama3"]) == "none"
    assert resolve_quantization("w8a8", "float32", "cpu") == "w8a8"  # asked for by name: served as asked
    monkeypatch.setattr(quantization, "int8_kernels_are_fast", lambda: True)
    assert resolve_quantization("auto", "float32", "cpu") == "w4a8"
    assert resolve_quantization("auto", "float32", "cpu", tensor_parallel_size=2) == "w8a8"
    assert resolve_quantization("auto", "float32", "cpu", tiny_dirs["llama3"]) == "w8a8"
    assert resolve_quantization("auto", "float32", "cpu", tiny_dirs["llama3"] / "missing.gguf") == "w8a8"
    assert resolve_quantization("auto", "bfloat16", "cpu") == "none"
    assert resolve_quantization("auto", "float32", "cuda") == "none"
    assert resolve_quantization("int8", "float32", "cpu") == "int8"
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        resolve_quantization("int4", "float32", "cpu")
    with pytest.raises(ValueError, match="starts from float32 weights"):
        load(tiny_dirs["llama3"], dtype="bfloat16", quantization="w8a8")
