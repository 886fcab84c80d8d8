"""Rotary position embeddings in the Hugging Face (half-split, "neox") layout: the angles.

The rotation itself is a kernel (`kernels/rotary.py`), chosen with the model's other ops.

Checkpoints from GGUF are converted to this layout when they are loaded (see `model/gguf_checkpoint.py`),
so one rotation serves both sources.
"""

from __future__ import annotations

import math

import torch

from kernels.rotary import rope_frequencies
from model.config import ModelConfig


def local_inverse_frequencies(config: ModelConfig) -> torch.Tensor | None:
    """[head_dim / 2] float32 frequencies of the sliding-window layers when they have a RoPE base of their
    own (Gemma 3: 10,000, unscaled); None when every layer rotates alike."""
    if config.rope_local_theta is None:
        return None
    return rope_frequencies(config.head_dim, config.rope_local_theta)


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] float32 angular frequency of each rotated pair (of the full-attention layers), with
    Llama 3 or linear scaling applied."""
    inv_freq = rope_frequencies(config.head_dim, config.rope_theta)
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



