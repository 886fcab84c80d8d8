"""kernels/moe.py: the grouped `fused_moe` against the per-expert reference on random inputs."""

from __future__ import annotations

import pytest
import torch

from kernels.moe import fused_moe, fused_moe_ref, moe_loop_hf, route
from kernels.runtime import HAS_TRITON, INTERPRETING

DEVICE = "cpu" if INTERPRETING or not torch.cuda.is_available() else "cuda"

E, H, INTER = 8, 48, 24


def weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * INTER, H, generator=g) * 0.2, torch.randn(E, H, INTER, generator=g) * 0.2


@pytest.mark.parametrize("num_tokens", [1, 2, 7, 33, 128])
@pytest.mark.parametrize("top_k,renormalize", [(1, True), (2, True), (2, False), (8, False)])
def test_fused_matches_reference(num_tokens, top_k, renormalize):
    w13, w2 = weights()
    g = torch.Generator().manual_seed(num_tokens)
    x, logits = torch.randn(num_tokens, H, generator=g), torch.randn(num_tokens, E, generator=g) * 3
    ref = fused_moe_ref(x, logits, w13, w2, top_k, renormalize)
    torch.testing.assert_close(fused_moe(x, logits, w13, w2, top_k, renormalize), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(moe_loop_hf(x, logits, w13, w2, top_k, renormalize), ref, rtol=1e-5, atol=1e-6)


def test_experts_with_no_tokens_and_one_token():
    """Every token on experts 2 and 5 except one on expert 7: six experts idle, one with a single row."""
    w13, w2 = weights(1)
    x = torch.randn(9, H)
    logits = torch.full((9, E), -10.0)
    logits[:, 2], logits[:, 5] = 4.0, 3.0
    logits[4] = -10.0
    logits[4, 7], logits[4, 0] = 5.0, 1.0
    _, experts = route(logits, 2, True)
    assert set(experts.flatten().tolist()) == {0, 2, 5, 7}
    torch.testing.assert_close(fused_moe(x, logits, w13, w2, 2), fused_moe_ref(x, logits, w13, w2, 2),
                               rtol=1e-5, atol=1e-6)


def test_route_renormalised_equals_softmax_over_top_k_logits():
    """Mixtral's form (softmax over the k largest logits) is the renormalised one."""
    logits = torch.randn(16, E)
    w, experts = route(logits, 2, renormalize=True)
    torch.testing.assert_close(w, torch.softmax(logits.gather(1, experts), dim=-1))
    w, _ = route(logits, 2, renormalize=False)
    assert (w.sum(-1) < 1).all()


def test_deterministic_and_batch_invariant_sum():
    """The same call twice gives the same bits; a token's row alone equals its row in a batch up to the
    GEMM's own rounding (its k expert outputs are summed in slot order either way)."""
    w13, w2 = weights(2)
    generator = torch.Generator().manual_seed(2)
    x, logits = torch.randn(40, H, generator=generator), torch.randn(40, E, generator=generator)
    first = fused_moe(x, logits, w13, w2, 2)
    assert torch.equal(first, fused_moe(x, logits, w13, w2, 2))
    alone = torch.cat([fused_moe(x[i:i + 1], logits[i:i + 1], w13, w2, 2) for i in range(40)])
    # A GEMM of one row and one of many may round a last bit differently (a 1.2e-6 difference was seen).
    torch.testing.assert_close(alone, first, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(8))
def test_bfloat16_stays_close_to_float32(seed):
    """bfloat16 arithmetic against float32 on the same routing: the reference routes on the bfloat16-rounded
    logits, since rounding can swap two near-tied experts, a different answer rather than a rounding error."""
    w13, w2 = weights(3)
    generator = torch.Generator().manual_seed(seed)
    x, logits = torch.randn(16, H, generator=generator), torch.randn(16, E, generator=generator)
    ref = fused_moe_ref(x, logits.bfloat16().float(), w13, w2, 2)
    low = fused_moe(x.bfloat16(), logits.bfloat16(), w13.bfloat16(), w2.bfloat16(), 2)
    assert low.dtype == torch.bfloat16
    assert ((low.float() - ref).norm() / ref.norm()).item() < 3e-2


@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_int8_experts_match_reference_on_their_dequantized_weights(num_tokens):
    from kernels.int8_matmul import quantize_int8_ref
    from kernels.moe import int8_moe, pack_int8_experts

    w13, w2 = weights(4)
    (q13, s13), (q2, s2) = (quantize_int8_ref(w.reshape(-1, w.shape[-1])) for w in (w13, w2))
    q13, s13, q2, s2 = q13.view(w13.shape), s13.view(E, -1), q2.view(w2.shape), s2.view(E, -1)
    x, logits = torch.randn(num_tokens, H), torch.randn(num_tokens, E)
    out = int8_moe(x, logits, pack_int8_experts(q13), s13, pack_int8_experts(q2), s2, 2)
    ref = fused_moe_ref(x, logits, q13.float() * s13[..., None], q2.float() * s2[..., None], 2)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("size", [2, 4])
def test_parts_of_the_experts_sum_to_the_whole(top_k, size):
    """Expert parallelism: each rank's stack of E / size experts (`expert_offset`) gives its share, 0 for
    pairs routed elsewhere; the shares add up to the whole, bit for bit up to two slots (adding an exact
    0 changes nothing, and a + b = b + a)."""
    from kernels.int8_matmul import quantize_int8_ref
    from kernels.moe import int8_moe, pack_int8_experts

    w13, w2 = weights(6)
    g = torch.Generator().manual_seed(size)
    x, logits = torch.randn(33, H, generator=g), torch.randn(33, E, generator=g) * 3
    n = E // size
    held = [slice(r * n, (r + 1) * n) for r in range(size)]
    parts = [fused_moe(x, logits, w13[s], w2[s], top_k, True, expert_offset=s.start) for s in held]
    for s, part in zip(held, parts):
        torch.testing.assert_close(part, fused_moe_ref(x, logits, w13[s], w2[s], top_k, True, expert_offset=s.start),
                                   rtol=1e-5, atol=1e-6)
    whole = fused_moe(x, logits, w13, w2, top_k, True)
    if top_k <= 2:
        assert torch.equal(sum(parts[1:], parts[0]), whole)
    torch.testing.assert_close(sum(parts[1:], parts[0]), whole, rtol=1e-5, atol=1e-6)
    (q13, s13), (q2, s2) = (quantize_int8_ref(w.reshape(-1, w.shape[-1])) for w in (w13, w2))
    q13, s13, q2, s2 = q13.view(w13.shape), s13.view(E, -1), q2.view(w2.shape), s2.view(E, -1)
    int8_parts = [int8_moe(x, logits, pack_int8_experts(q13[s]), s13[s], pack_int8_experts(q2[s]), s2[s], top_k,
                           expert_offset=s.start) for s in held]
    int8_whole = int8_moe(x, logits, pack_int8_experts(q13), s13, pack_int8_experts(q2), s2, top_k)
    torch.testing.assert_close(sum(int8_parts[1:], int8_parts[0]), int8_whole, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="not among the router's 8"):
        fused_moe(x, logits, w13[:n], w2[:n], top_k, expert_offset=E - n + 1)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("num_tokens,top_k", [(1, 2), (13, 2), (40, 3)])
def test_triton_grouped_gemm_runs_a_part_of_the_experts(num_tokens, top_k):
    """`expert_offset` on the Triton form: pairs routed to other experts stay 0 (interpreted on a CPU)."""
    from kernels.moe import fused_moe_triton

    w13, w2 = weights(7)
    x, logits = torch.randn(num_tokens, H, device=DEVICE), torch.randn(num_tokens, E, device=DEVICE) * 3
    w13, w2 = w13.to(DEVICE), w2.to(DEVICE)
    for s in (slice(0, 4), slice(4, 8), slice(2, 5)):
        out = fused_moe_triton(x, logits, w13[s], w2[s], top_k, expert_offset=s.start)
        ref = fused_moe_ref(x, logits, w13[s], w2[s], top_k, expert_offset=s.start)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("num_tokens,top_k", [(1, 2), (13, 2), (40, 3)])
def test_triton_grouped_gemm_matches_reference(num_tokens, top_k):
    """The Triton form (interpreted on a CPU) against the reference; `align_pairs` pads every expert's run."""
    from kernels.moe import align_pairs, fused_moe_triton

    w13, w2 = weights(5)
    x, logits = torch.randn(num_tokens, H, device=DEVICE), torch.randn(num_tokens, E, device=DEVICE)
    w13, w2 = w13.to(DEVICE), w2.to(DEVICE)
    _, experts = route(logits, top_k, True)
    slot_pair, block_expert, pair_slot = align_pairs(experts, E, 16)
    assert torch.equal(slot_pair[pair_slot], torch.arange(num_tokens * top_k, device=DEVICE))
    used = block_expert < E
    assert torch.equal(block_expert[used], block_expert[used].sort().values)
    out = fused_moe_triton(x, logits, w13, w2, top_k)
    torch.testing.assert_close(out, fused_moe_ref(x, logits, w13, w2, top_k), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_sparse_moe_block_runs_triton_on_the_triton_side():
    from kernels.ops import TORCH_OPS, TRITON_OPS
    from model.config import ModelConfig
    from model.moe import SparseMoeBlock

    config = ModelConfig("mixtral", vocab_size=32, hidden_size=H, intermediate_size=INTER, num_layers=1,
                         num_heads=2, num_kv_heads=2, head_dim=H // 2, rms_norm_eps=1e-5, rope_theta=1e4,
                         max_position_embeddings=64, tie_word_embeddings=False, num_experts=E,
                         num_experts_per_tok=2, moe_intermediate_size=INTER)
    torch.manual_seed(0)
    eager = SparseMoeBlock(config, TORCH_OPS)
    for p in eager.parameters():
        torch.nn.init.normal_(p, std=0.2)
    triton_block = SparseMoeBlock(config, TRITON_OPS)
    triton_block.load_state_dict(eager.state_dict())
    x = torch.randn(21, H)
    with torch.no_grad():
        torch.testing.assert_close(triton_block(x), eager(x), rtol=1e-5, atol=1e-5)
