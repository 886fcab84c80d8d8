"""Rotary position embeddings in the Hugging Face (half-split, "neox") layout: the angles.

The rotation itself is a kernel (`kernels/rotary.py`), chosen with the model's other ops.

Checkpoints from GGUF are converted to this layout when they are loaded (see `model/gguf_checkpoint.py`),
so one rotation serves both sources.
"""

from __future__ import annotations

import math

import torch

from kernels.rotary import rope_frequencies
from model.config import ModelConfig, YarnScaling


def rotary_scale(config: ModelConfig) -> torch.Tensor | None:
    """[head_dim / 2] float32 factor on each rotated pair's cos and sin (LongRoPE's attention factor; 1 on the
    pairs that do not rotate), or None for none."""
    if config.rope_attention_factor is None or config.rope_attention_factor == 1.0:
        return None
    rotated = config.rotary_dims // 2
    scale = torch.ones(config.head_dim // 2)
    scale[:rotated] = config.rope_attention_factor
    return scale


def local_inverse_frequencies(config: ModelConfig) -> torch.Tensor | None:
    """[head_dim / 2] float32 frequencies of the sliding-window layers when they have a RoPE base of their
    own (Gemma 3: 10,000, unscaled); None when every layer rotates alike."""
    if config.rope_local_theta is None:
        return None
    return rope_frequencies(config.head_dim, config.rope_local_theta)


def inverse_frequencies(config: ModelConfig, long_context: bool = False) -> torch.Tensor:
    """[head_dim / 2] float32 angular frequency of each rotated pair (of the full-attention layers), with
    Llama 3, linear or LongRoPE scaling applied (LongRoPE's long factors with `long_context`). With a rotary
    part of each head (`rotary_dim`), the pairs past it have frequency 0: no rotation (their weights' rows
    are ordered so: model/weights.py `phi3_rows`). Proportional RoPE (Gemma 4's full-attention layers, whose
    head size is `global_head_dim`): the first pairs rotate at the whole head's frequencies, the rest do not."""
    if config.rope_proportion is not None:
        head = config.global_head_dim or config.head_dim
        rotated = int(config.rope_proportion * head // 2)
        return torch.cat([rope_frequencies(head, config.rope_theta)[:rotated], torch.zeros(head // 2 - rotated)])
    if config.rotary_dims != config.head_dim:
        rotated = inverse_frequencies(config.replace(head_dim=config.rotary_dims, rotary_dim=None), long_context)
        return torch.cat([rotated, torch.zeros((config.head_dim - config.rotary_dims) // 2)])
    if config.rope_long_freq_factors is not None:  # LongRoPE, in transformers' arithmetic
        factors = config.rope_long_freq_factors if long_context else config.rope_freq_factors
        exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * config.rope_theta ** exponents)
    inv_freq = rope_frequencies(config.head_dim, config.rope_theta)
    if config.rope_yarn is not None:
        return yarn_frequencies(config.rope_yarn, config.head_dim, config.rope_theta)
    if config.rope_linear_factor is not None:
        return inv_freq / config.rope_linear_factor
    if config.rope_freq_factors is not None:
        return inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band between the
    # two cut-offs is interpolated linearly in 1/wavelength.
    old_len = scaling.original_max_position_embeddings
    low_cut = old_len / scaling.low_freq_factor  # wavelengths above this are scaled fully
    high_cut = old_len / scaling.high_freq_factor  # wavelengths below this are left alone
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > low_cut, inv_freq / scaling.factor, inv_freq)
    blend = (old_len / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - blend) * scaled / scaling.factor + blend * scaled
    in_band = (wavelength >= high_cut) & (wavelength <= low_cut)
    return torch.where(in_band, blended, scaled)





def yarn_frequencies(yarn: YarnScaling, dim: int, base: float) -> torch.Tensor:
    """[dim / 2] float32: YaRN's frequencies. A pair that turns more than `beta_fast` times over the original
    context keeps its frequency, one that turns fewer than `beta_slow` times is divided by `factor`, and
    those between are blended along a linear ramp over the pair index (in transformers' float32 arithmetic)."""

    def pair_turning(turns: float) -> float:  # the (fractional) pair index whose wavelength fits `turns` times
        return dim * math.log(yarn.original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(yarn.beta_fast), pair_turning(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of no width: a step
    kept = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    wavelengths = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)  # over 2 pi
    return 1.0 / (yarn.factor * wavelengths) * (1 - kept) + 1.0 / wavelengths * kept
