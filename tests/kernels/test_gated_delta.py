"""The gated delta rule's chunked (prefill) and one-token (decode) forms against the token-by-token reference and
transformers' own functions, and the causal convolution against torch's conv1d."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from kernels.gated_delta import causal_conv, chunked_delta_rule, delta_rule_step, l2_normalize, recurrent_delta_rule


def inputs(length: int, heads: int = 4, key_dim: int = 16, value_dim: int = 8, seed: int = 0):
    """Raw queries and keys [L, H, Dk], values [L, H, Dv], decays g <= 0 and rates beta [L, H], a state."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(length, heads, key_dim, generator=gen), torch.randn(length, heads, key_dim, generator=gen)
    v = torch.randn(length, heads, value_dim, generator=gen)
    g = -3 * torch.rand(length, heads, generator=gen)  # some decays near 0, some near 1
    beta = torch.rand(length, heads, generator=gen)
    return q, k, v, g, beta, torch.randn(heads, key_dim, value_dim, generator=gen)


def normed(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return l2_normalize(q) * q.shape[-1] ** -0.5, l2_normalize(k)


@pytest.mark.parametrize("length", [1, 63, 64, 65, 150])
def test_chunks_and_single_steps_equal_the_rule_token_by_token(length):
    q, k, v, g, beta, state = inputs(length)
    q, k = normed(q, k)
    ref_state = state.clone()
    ref = recurrent_delta_rule(q, k, v, g, beta, ref_state)
    chunk_state = state.clone()
    out = chunked_delta_rule(q, k, v, g, beta, chunk_state)
    assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(chunk_state, ref_state, atol=1e-5)
    step_state = state[None].clone()
    steps = torch.cat([delta_rule_step(q[t][None], k[t][None], v[t][None], g[t][None], beta[t][None], step_state)
                       for t in range(length)])
    assert torch.allclose(steps, ref, atol=1e-5) and torch.allclose(step_state[0], ref_state, atol=1e-5)


def test_the_chunked_rule_is_transformers_own():
    """transformers' chunked function (its normalisation inside, from a given state, 64-token chunks)."""
    q, k, v, g, beta, state = inputs(150, seed=1)
    ref, ref_state = torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                  initial_state=state[None].clone(), output_final_state=True,
                                                  use_qk_l2norm_in_kernel=True)
    qn, kn = normed(q, k)
    ours = state.clone()
    assert torch.allclose(chunked_delta_rule(qn, kn, v, g, beta, ours), ref[0], atol=1e-5)
    assert torch.allclose(ours, ref_state[0], atol=1e-5)


def test_a_decode_step_is_the_same_in_any_batch():
    """Each sequence's output and state bit for bit whether it steps alone or beside six others."""
    q, k, v, g, beta, _ = inputs(7, seed=2)
    states = torch.randn(7, 4, 16, 8, generator=torch.Generator().manual_seed(3))
    together = states.clone()
    out = delta_rule_step(q, k, v, g, beta, together)
    for b in range(7):
        alone = states[b:b + 1].clone()
        assert torch.equal(delta_rule_step(q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1], beta[b:b + 1], alone),
                           out[b:b + 1])
        assert torch.equal(alone, together[b:b + 1])


def test_the_causal_convolution_is_conv1d_from_the_carried_inputs():
    """A run of 9 after 3 carried inputs equals conv1d (zero-padded) over the whole 12, the carried rows' outputs
    dropped; the taps apply oldest first."""
    gen = torch.Generator().manual_seed(4)
    channels, taps = 6, 4
    weight, series = torch.randn(channels, taps, generator=gen), torch.randn(12, channels, generator=gen)
    ref = torch.nn.functional.conv1d(series.T[None], weight[:, None], padding=taps - 1, groups=channels)[0, :, :12]
    ref = torch.nn.functional.silu(ref).T
    window = torch.cat([torch.zeros(taps - 1, channels), series])
    assert torch.allclose(causal_conv(window, weight), ref, atol=1e-6)
    assert torch.allclose(causal_conv(series, weight), ref[taps - 1:], atol=1e-6)


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("hk, hv, dk, dv", [(2, 4, 16, 8), (1, 2, 32, 160)])
def test_the_decode_op_is_its_reference(tiled, hk, hv, dk, dv):
    """ladder::gated_delta_decode (C++ where built) against its torch reference: three sequences in slots 4, 0 and 2
    of a pool of 5, key heads serving twice as many value heads (values of 160 dims: a vector tile and the columns
    past it); outputs and every pool row (the slots' states and inputs advanced, the others untouched)."""
    from kernels.gated_delta import gated_delta_decode, gated_delta_decode_ref

    gen = torch.Generator().manual_seed(5)
    taps = 4
    channels = 2 * hk * dk + hv * dv
    projected = torch.randn(3, channels + hv * dv + 2 * hv, generator=gen)
    pool = torch.randn(5, (taps - 1) * channels + hv * dk * dv, generator=gen)
    slots = torch.tensor([4, 0, 2])
    weights = (torch.randn(taps, channels, generator=gen), torch.randn(hv, generator=gen),
               torch.randn(hv, generator=gen), 1 + 0.2 * torch.randn(dv, generator=gen))
    ref_pool = pool.clone()
    ref = gated_delta_decode_ref(projected, ref_pool, slots, *weights, hk, dk, dv, tiled, 1e-6)
    out = gated_delta_decode(projected, pool, slots, *weights, hk, dk, dv, tiled, 1e-6)
    assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(pool, ref_pool, atol=1e-5)
    assert torch.equal(pool[[1, 3]], ref_pool[[1, 3]])
    alone = pool.clone()  # the same step for the second sequence alone: bit for bit
    again = gated_delta_decode(projected[1:2], alone, slots[1:2], *weights, hk, dk, dv, tiled, 1e-6)
    twice = pool.clone()
    assert torch.equal(again, gated_delta_decode(projected, twice, slots, *weights, hk, dk, dv, tiled, 1e-6)[1:2])


def test_the_prompt_convolution_op_is_its_reference():
    """ladder::causal_conv (C++ where built) over a window [K - 1 + L, C] with taps [K, C]: the reference's outputs,
    channels past the last vector lane included (C = 100)."""
    from kernels.gated_delta import causal_conv_taps, causal_conv_taps_ref

    gen = torch.Generator().manual_seed(6)
    window, taps = torch.randn(3 + 37, 100, generator=gen), torch.randn(4, 100, generator=gen)
    assert torch.allclose(causal_conv_taps(window, taps), causal_conv_taps_ref(window, taps), atol=1e-5)
    assert causal_conv_taps(window[:3], taps).shape == (0, 100)
