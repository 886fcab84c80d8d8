"""The rotary angles' cos and sin on a CPU (kernels/rotary.py `rotary_cos_sin_ref`): the float32 rounding of
each float32 angle's float64 cos and sin, whatever the step around a position holds. torch's own float32
cos once came back with a thread's share at reduced accuracy on a process's first call (errors up to
1.5e-4), which made tests/model/test_cpu_step.py fail in about half the runs that followed other tests."""

from __future__ import annotations

import math

import torch

from kernels.rotary import rope_frequencies, rotary_cos_sin_ref


def test_cos_and_sin_are_the_float64_values_rounded():
    positions = torch.arange(0, 131072, 17)  # [7711]: a long context's positions
    inv_freq = rope_frequencies(64, 100000.0)  # SmolLM2's base
    cos, sin = rotary_cos_sin_ref(positions, inv_freq)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (len(positions), 32)
    angles = (positions.float()[:, None] * inv_freq[None, :]).double().flatten().tolist()
    assert torch.equal(cos.flatten(), torch.tensor([math.cos(a) for a in angles], dtype=torch.float32))
    assert torch.equal(sin.flatten(), torch.tensor([math.sin(a) for a in angles], dtype=torch.float32))


def test_a_position_has_the_same_angles_in_any_step():
    inv_freq = rope_frequencies(64, 10000.0)
    batch = torch.tensor([3, 900, 4095, 5, 0, 77])
    cos, sin = rotary_cos_sin_ref(batch, inv_freq)
    for i, position in enumerate(batch.tolist()):
        alone_cos, alone_sin = rotary_cos_sin_ref(torch.tensor([position]), inv_freq)
        assert torch.equal(alone_cos[0], cos[i]) and torch.equal(alone_sin[0], sin[i])
