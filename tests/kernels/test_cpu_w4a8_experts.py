"""kernels/cpu_w4a8_experts.py: a MoE layer's W4A8 experts as one C++ call, equal bit for bit to the loop over
experts it replaces, close to float experts on the same weights, and refusing bad inputs in one line."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_w4a8_linear
from kernels.cpu_w4a8_experts import w4a8_experts, w4a8_experts_ref
from kernels.moe import fused_moe_ref, route, w4a8_moe
from kernels.swiglu import clamped_swiglu_ref

pytestmark = pytest.mark.skipif(cpu_w4a8_linear.load() is None, reason="the CPU kernels could not be built here "
                                "(a C++ compiler is needed); the references alone run")

E, H, INTER = 8, 64, 96


def experts(bits: int, seed: int = 0):
    """Random packed experts: (w13 codes, scales), (w2 codes, scales), zero, and their float weights [E, N, K]."""
    g = torch.Generator().manual_seed(seed)
    top, zero = 1 << bits, 1 << (bits - 1)
    stacks, floats = [], []
    for n, k in ((2 * INTER, H), (H, INTER)):
        codes = torch.randint(0, top, (E, n, k), generator=g, dtype=torch.uint8)
        d = (torch.rand(E, n, k // 32, generator=g) * 0.3 / top + 1e-3).half()
        # 6-bit codes (Q6_K) weigh each 16 inputs by an int8 sub-scale: here 1 .. 8, d scaled down to match.
        sub = torch.randint(1, 9, (E, n, k // 16), generator=g, dtype=torch.int8) if bits == 6 else None
        if sub is not None:
            d = (d.float() / 4).half()
        packed = [cpu_w4a8_linear.pack(codes[e], d[e], None, bits, None if sub is None else sub[e]) for e in range(E)]
        stacks.append((torch.stack([c for c, _ in packed]), torch.stack([s for _, s in packed])))
        scale = d.float().repeat_interleave(32, dim=-1)
        if sub is not None:
            scale = scale * sub.float().repeat_interleave(16, dim=-1)
        floats.append((codes.float() - zero) * scale)
    return stacks, zero, floats


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("num_tokens,top_k", [(1, 2), (5, 3), (33, 2), (64, 8)])
def test_one_call_equals_the_loop_over_experts(bits, num_tokens, top_k):
    (w13, w2), zero, (f13, f2) = experts(bits, seed=bits)
    x, logits = torch.randn(num_tokens, H), torch.randn(num_tokens, E)
    weights, chosen = route(logits, top_k, True)
    args = (x, weights.contiguous(), chosen.contiguous(), *w13, zero, *w2, zero)
    out = w4a8_experts(*args, 0)
    assert torch.equal(out, w4a8_experts_ref(*args, 0))
    assert torch.equal(out, w4a8_moe(x, logits, *w13, zero, *w2, zero, top_k))
    # int8 activations against float experts on the same weights: the W4A8 rounding only.
    reference = fused_moe_ref(x, logits, f13, f2, top_k)
    assert ((out - reference).norm() / reference.norm()).item() < 0.03
    # A part of the experts (expert parallelism's stack): its pairs only, the rest 0, equal to the loop too.
    part = (x, weights.contiguous(), chosen.contiguous(), w13[0][2:6].contiguous(), w13[1][2:6].contiguous(), zero,
            w2[0][2:6].contiguous(), w2[1][2:6].contiguous(), zero)
    assert torch.equal(w4a8_experts(*part, 2), w4a8_experts_ref(*part, 2))


@pytest.mark.parametrize("bits", [4, 8])
def test_gemma4_gelu_experts_equal_their_loop_and_gelu_float_experts(bits):
    """`gelu` (Gemma 4's experts): gelu_tanh(gate) * up in the same one call, equal to the loop over experts and
    within the W4A8 rounding of float experts on the same weights."""
    (w13, w2), zero, (f13, f2) = experts(bits, seed=10 + bits)
    x, logits = torch.randn(9, H), torch.randn(9, E)
    weights, chosen = route(logits, 2, True)
    args = (x, weights.contiguous(), chosen.contiguous(), *w13, zero, *w2, zero, 0)
    out = w4a8_experts(*args, True)
    assert torch.equal(out, w4a8_experts_ref(*args, True))
    assert not torch.equal(out, w4a8_experts(*args, False))
    reference = torch.zeros_like(x)
    for t in range(9):
        for w, e in zip(weights[t].tolist(), chosen[t].tolist()):
            gate, up = (f13[e] @ x[t]).chunk(2)
            reference[t] += w * (f2[e] @ (torch.nn.functional.gelu(gate, approximate="tanh") * up))
    assert ((out - reference).norm() / reference.norm()).item() < 0.03


def test_batch_invariant():
    """A token's output does not depend on which other tokens share the call."""
    (w13, w2), zero, _ = experts(4, seed=3)
    x, logits = torch.randn(17, H), torch.randn(17, E)
    together = w4a8_moe(x, logits, *w13, zero, *w2, zero, 2)
    alone = torch.cat([w4a8_moe(x[i:i + 1], logits[i:i + 1], *w13, zero, *w2, zero, 2) for i in range(17)])
    assert torch.equal(together, alone)


def test_bad_inputs_are_refused_in_one_line():
    (w13, w2), zero, _ = experts(4)
    x = torch.randn(3, H)
    weights, chosen = route(torch.randn(3, E), 2, True)
    weights, chosen = weights.contiguous(), chosen.contiguous()
    with pytest.raises(RuntimeError, match="experts: \\[T, k\\] int64"):
        w4a8_experts(x, weights, chosen.int(), *w13, zero, *w2, zero, 0)
    with pytest.raises(RuntimeError, match="96 rows do not match 4 packed blocks"):  # w2 holds H = 64 rows
        w4a8_experts(torch.randn(3, H + 32), weights, chosen, *w13, zero, *w2, zero, 0)
    with pytest.raises(RuntimeError, match="w2 codes"):
        w4a8_experts(x, weights, chosen, *w13, zero, w2[0][..., :100].contiguous(), w2[1], zero, 0)
    with pytest.raises(ValueError, match="not among the router's"):
        w4a8_moe(x, torch.randn(3, E), *w13, zero, *w2, zero, 2, expert_offset=4)


def test_gpt_oss_experts_with_biases_and_the_clamped_swiglu_equal_their_loop():
    """GPT-OSS's experts (W4A8GptOssMoeBlock): each expert's biases added by its linears and the clamped SwiGLU,
    in the one call, equal to the loop over experts bit for bit and within the W4A8 rounding of float experts;
    gates past the clamp occur (the biases push them there)."""
    (w13, w2), zero, (f13, f2) = experts(4, seed=21)
    g = torch.Generator().manual_seed(22)
    b13, b2 = torch.randn(E, 2 * INTER, generator=g) * 4, torch.randn(E, H, generator=g)
    x, logits = torch.randn(9, H, generator=g), torch.randn(9, E, generator=g)
    weights, chosen = route(logits, 2, True)
    args = (x, weights.contiguous(), chosen.contiguous(), *w13, zero, *w2, zero, 0, False, b13, b2, 7.0, 1.702)
    out = w4a8_experts(*args)
    assert torch.equal(out, w4a8_experts_ref(*args))
    reference = torch.zeros_like(x)
    clamped = 0
    for t in range(9):
        for w, e in zip(weights[t].tolist(), chosen[t].tolist()):
            gate_up = f13[e] @ x[t] + b13[e]
            clamped += int((gate_up[:INTER] > 7).sum())
            reference[t] += w * (f2[e] @ clamped_swiglu_ref(gate_up, 1.702, 7.0) + b2[e])
    assert clamped and ((out - reference).norm() / reference.norm()).item() < 0.03
    with pytest.raises(RuntimeError, match="w13_bias"):
        w4a8_experts(*args[:11], b13[:, :5].contiguous(), b2, 7.0, 1.702)
