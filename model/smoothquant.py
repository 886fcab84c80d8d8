"""SmoothQuant: move activation outliers into the weights before W8A8 quantization.

Per-token int8 activations lose the small channels of a row when a few channels are large: RMSNorm
weights make some input channels of q/k/v and gate/up consistently tens of times larger than the rest.
For a linear y = x W^T, any per-channel s > 0 gives the same y as (x / s)(W s)^T; choosing
s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha) evens out the channels of x at the cost of those of W
(weights are quantized per output channel, so they take it better). The division by s is folded into
whatever produces x, so it costs nothing at run time:

  qkv_proj  input = input_layernorm(h)           -> input_layernorm.weight /= s
                                                    (Qwen3.5's linear-attention layers: linear_attn.in_proj)
  gate_up   input = post_attention_layernorm(h)  -> post_attention_layernorm.weight /= s
                                                    (Gemma: pre_feedforward_layernorm, `mlp_norm`)
  down_proj input = silu(gate) * up              -> the up rows of gate_up_proj /= s (up is linear)
  lm_head   input = norm(h)                      -> norm.weight /= s (a tied head is untied first)

o_proj is left alone (its input, the attention output, showed no outliers worth the GQA bookkeeping).
Calibration runs the fp32 model over Python's `pydoc_data.topics` from token 4,096 on, so it never
overlaps the 2,048 tokens the parity report's perplexity is measured on. Each linear gets its own alpha:
the one of ALPHAS whose W8A8 product is closest (mean squared error) to the fp32 product on a sample of
its calibration inputs.

SmolLM2-135M-Instruct, eager W8A8 on every linear, perplexity change on the parity text (2026-11-30):
no smoothing +5.8%; one alpha for all, 0.4 +1.52%, 0.5 +1.71%, 0.6 +1.29%, 0.75 +2.75%; each linear
its own alpha +0.82% (chosen: 0.7 for 35 linears, 0.8 for 26, 0.6 for 17, 0.5 for 8 and the LM head,
0.9 for 5).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from kernels.cpu_w8a8_linear import pack, w8a8_linear
from kernels.int8_matmul import quantize_int8_ref
from model.llama import LlamaForCausalLM
from model.perplexity import corpus_text, token_nll

log = logging.getLogger(__name__)

ALPHAS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
CALIBRATION_START = 4096  # tokens of the built-in text skipped: the perplexity slice lies before
CALIBRATION_TOKENS = 2048
SAMPLE_EVERY = 4  # calibration rows kept per linear for choosing alpha (512 of 2,048)


def calibration_ids(tokenizer, vocab_size: int) -> list[int]:
    """Calibration tokens: the built-in text past the perplexity slice (fixed pseudo-random ids for a
    model without a tokenizer)."""
    if tokenizer is None:
        generator = torch.Generator().manual_seed(1)
        return torch.randint(0, vocab_size, (CALIBRATION_TOKENS,), generator=generator).tolist()
    ids = tokenizer.encode(corpus_text(), add_special_tokens=False)
    return ids[CALIBRATION_START:CALIBRATION_START + CALIBRATION_TOKENS]


@dataclass
class LinearInputs:
    absmax: torch.Tensor  # [K] max |x_j| over every calibration token
    sample: torch.Tensor  # [rows, K] every SAMPLE_EVERY-th calibration row


@torch.inference_mode()
def linear_inputs(module: LlamaForCausalLM, token_ids: list[int]) -> dict[str, LinearInputs]:
    """What each nn.Linear of the fp32 module sees on the calibration tokens, by name."""
    absmax: dict[str, torch.Tensor] = {}
    samples: dict[str, list[torch.Tensor]] = {}

    def record(name: str):
        def hook(_module, inputs, _output) -> None:
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
            seen = x.abs().amax(dim=0)
            absmax[name] = torch.maximum(absmax[name], seen) if name in absmax else seen
            samples.setdefault(name, []).append(x[::SAMPLE_EVERY].clone())
        return hook

    hooks = [m.register_forward_hook(record(name)) for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    try:
        token_nll(module, token_ids)  # chunked prefill over the text, as the engine runs it
    finally:
        for hook in hooks:
            hook.remove()
    return {name: LinearInputs(absmax[name], torch.cat(samples[name])) for name in absmax}


def smoothing_scales(x_absmax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """s [K] = max|x_j|^alpha / max|W_:,j|^(1 - alpha) for weight [N, K]."""
    w_absmax = weight.detach().abs().amax(dim=0).float().clamp(min=1e-5)
    return (x_absmax.clamp(min=1e-5).pow(alpha) / w_absmax.pow(1 - alpha)).clamp(min=1e-5)


def choose_scales(inputs: LinearInputs, weight: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(alpha, s [K]) of ALPHAS whose W8A8 product of the sampled inputs is closest to fp32's."""
    x, w = inputs.sample, weight.detach().float()
    exact = x @ w.T
    best: tuple[float, float, torch.Tensor] | None = None
    for alpha in ALPHAS:
        s = smoothing_scales(inputs.absmax, w, alpha)
        w_q, w_scale = quantize_int8_ref(w * s)
        # The C++ kernel (bit for bit the reference's torch._int_mm product, ~10x faster on a CPU without
        # AVX-512 VNNI, where _int_mm has no fast path).
        product = w8a8_linear(x / s, *pack(w_q), w_scale, None, w_q.shape[0])
        error = (product - exact).pow(2).mean().item()
        if best is None or error < best[0]:
            best = (error, alpha, s)
    return best[1], best[2]


@dataclass
class Smoothing:
    """Per smoothed linear (by name): the alpha chosen and the scales s [K] it gives."""

    alphas: dict[str, float]
    scales: dict[str, torch.Tensor]


@torch.no_grad()
def calibrate(module: LlamaForCausalLM, token_ids: list[int]) -> Smoothing:
    """Choose each smoothed linear's alpha and scales on the fp32 module (left unchanged)."""
    inputs = linear_inputs(module, token_ids)
    alphas, scales = {}, {}
    for name, linear in smoothed_linears(module).items():
        alphas[name], scales[name] = choose_scales(inputs[name], linear.weight)
    return Smoothing(alphas, scales)


def mixer_input(layer: nn.Module) -> tuple[str, nn.Linear]:
    """The linear that reads a layer's input norm, by its name in the layer: the attention's q/k/v, or a
    linear-attention layer's input projection (Qwen3.5)."""
    if layer.linear_attn is not None:
        return "linear_attn.in_proj", layer.linear_attn.in_proj
    return "self_attn.qkv_proj", layer.self_attn.qkv_proj


def smoothed_linears(module: LlamaForCausalLM) -> dict[str, nn.Linear]:
    """Every linear smoothing touches, by name (module.named_modules names)."""
    found = {}
    for i, layer in enumerate(module.layers):
        name, linear = mixer_input(layer)
        found[f"layers.{i}.{name}"] = linear
        found[f"layers.{i}.mlp.gate_up_proj"] = layer.mlp.gate_up_proj
        found[f"layers.{i}.mlp.down_proj"] = layer.mlp.down_proj
    found["lm_head"] = module.lm_head
    return found


@torch.no_grad()
def apply(module: LlamaForCausalLM, smoothing: Smoothing) -> None:
    """Fold the scales into the fp32 module in place: its outputs are unchanged up to rounding."""
    if module.lm_head.weight is module.embed_tokens.weight:  # the embedding lookup keeps the unscaled table
        module.lm_head.weight = nn.Parameter(module.embed_tokens.weight.detach().clone(), requires_grad=False)

    def fold(norm_weight: torch.Tensor, linear: nn.Linear, name: str) -> None:
        s = smoothing.scales[name]
        if s.shape != (linear.in_features,):
            raise ValueError(f"smoothing scales for {name} have shape {tuple(s.shape)}, "
                             f"the layer takes {linear.in_features} inputs")
        norm_weight.div_(s.to(norm_weight.dtype))
        linear.weight.mul_(s.to(linear.weight.dtype))

    for i, layer in enumerate(module.layers):
        mlp = layer.mlp
        name, linear = mixer_input(layer)
        fold(layer.input_layernorm.weight, linear, f"layers.{i}.{name}")
        fold(layer.mlp_norm.weight, mlp.gate_up_proj, f"layers.{i}.mlp.gate_up_proj")
        intermediate = mlp.down_proj.in_features
        fold(mlp.gate_up_proj.weight[intermediate:].T, mlp.down_proj, f"layers.{i}.mlp.down_proj")
    fold(module.norm.weight, module.lm_head, "lm_head")


def smooth(module: LlamaForCausalLM, token_ids: list[int]) -> dict[str, float]:
    """Calibrate and fold in one go; returns the alpha chosen for each smoothed linear, by name."""
    smoothing = calibrate(module, token_ids)
    apply(module, smoothing)
    return smoothing.alphas


# -- the calibration cache: smoothing computed once per model file, reused at every start ---------------

CACHE_FORMAT = "ladder-smoothquant"
CACHE_VERSION = "1"


def cache_dir() -> Path:
    """$LADDER_CACHE_DIR/smoothquant, or ~/.cache/ladder/smoothquant."""
    root = os.environ.get("LADDER_CACHE_DIR") or Path.home() / ".cache" / "ladder"
    return Path(root) / "smoothquant"


def cache_key(weights_sha256: str, token_ids: list[int]) -> str:
    """The model's weights and the calibration tokens (the built-in text differs between Pythons)."""
    tokens = hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()
    return hashlib.sha256(f"{weights_sha256}:{tokens}:{CACHE_VERSION}".encode()).hexdigest()


def save(smoothing: Smoothing, path: Path, key: str) -> None:
    """A safetensors file of the scales, with the key and the alphas in its header; written to a
    temporary name and renamed, so a crash never leaves half a file under the real name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": CACHE_FORMAT, "version": CACHE_VERSION, "key": key,
                "alphas": json.dumps(smoothing.alphas, sort_keys=True)}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file({name: s.contiguous() for name, s in smoothing.scales.items()}, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read(path: Path, key: str, module: LlamaForCausalLM) -> Smoothing | None:
    """The cached smoothing if the file is whole, was made for this key, and fits this module; else None."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if (meta.get("format"), meta.get("version"), meta.get("key")) != (CACHE_FORMAT, CACHE_VERSION, key):
                return None
            scales = {name: f.get_tensor(name) for name in f.keys()}
            alphas = json.loads(meta["alphas"])
    except (OSError, ValueError, KeyError, json.JSONDecodeError, SafetensorError):
        return None
    linears = smoothed_linears(module)
    if set(scales) != set(linears) or set(alphas) != set(linears):
        return None
    if any(scales[n].shape != (m.in_features,) or scales[n].dtype != torch.float32 for n, m in linears.items()):
        return None
    return Smoothing(alphas, scales)


def cached_smoothing(module: LlamaForCausalLM, tokenizer, weights_sha256: str) -> tuple[Smoothing, Path, bool]:
    """(smoothing, its cache file, whether it came from the cache) for this fp32 module: read from the
    cache when a valid file exists, else calibrated now (seconds) and saved for the next start."""
    token_ids = calibration_ids(tokenizer, module.config.vocab_size)
    key = cache_key(weights_sha256, token_ids)
    path = cache_dir() / f"{key[:32]}.safetensors"
    if path.is_file():
        smoothing = read(path, key, module)
        if smoothing is not None:
            return smoothing, path, True
        log.warning("%s is not a valid SmoothQuant cache for this model: calibrating again", path)
    smoothing = calibrate(module, token_ids)
    try:
        save(smoothing, path, key)
    except OSError as error:  # a read-only home: serve anyway, calibrate again next time
        log.warning("cannot cache the SmoothQuant calibration at %s: %s", path, error)
    return smoothing, path, False
