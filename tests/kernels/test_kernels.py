"""Each Triton kernel against its plain-torch reference on random inputs, and the kernel dispatch.

Without CUDA the kernels run under Triton's interpreter (kernels/runtime.py turns it on), so the
shapes are small; they still include the default model's (hidden 576, 9 query and 3 KV heads of 64).
Every buffer a launcher allocates is filled with NaN first, so an element a kernel fails to write fails
the comparison.
"""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, DTYPES, assert_matches, poisoned_allocations, randn

from kernels.runtime import HAS_TRITON, INTERPRETING, TRITON_IMPORT_ERROR

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason=f"triton is not importable ({TRITON_IMPORT_ERROR})")


# --- RMSNorm -------------------------------------------------------------------------------------

NORM_SHAPES = [(1, 576), (7, 576), (3, 9, 64), (5, 100)]  # hidden size, a q_norm's [T, heads, d], odd width


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_rms_norm_matches_reference(shape, dtype):
    from kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref

    x, residual = randn(*shape, dtype=dtype, seed=1), randn(*shape, dtype=dtype, seed=2)
    weight = randn(shape[-1], dtype=dtype, seed=3)
    with poisoned_allocations():
        out = rms_norm(x, weight, 1e-6)
        normed, summed = fused_add_rms_norm(x, residual, weight, 1e-5)
    assert_matches(out, rms_norm_ref(x, weight, 1e-6))
    ref_normed, ref_summed = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    assert_matches(normed, ref_normed)
    assert_matches(summed, ref_summed)


def test_rms_norm_reads_rows_at_a_wider_stride():
    """q of a fused qkv output: heads contiguous, tokens at a wider stride."""
    from kernels.rms_norm import rms_norm, rms_norm_ref

    qkv = randn(5, 15 * 64)
    q = qkv[:, : 9 * 64].view(5, 9, 64)
    weight = randn(64, seed=4)
    assert_matches(rms_norm(q, weight, 1e-6), rms_norm_ref(q, weight, 1e-6))


# --- Rotary --------------------------------------------------------------------------------------

def llama3_inv_freq(head_dim: int) -> torch.Tensor:
    from model.config import ModelConfig, RopeScaling
    from model.rope import inverse_frequencies

    config = ModelConfig(
        architecture="llama", vocab_size=8, hidden_size=9 * head_dim, intermediate_size=8, num_layers=1,
        num_heads=9, num_kv_heads=3, head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=500000.0,
        max_position_embeddings=8192, tie_word_embeddings=False,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=64),
    )
    return inverse_frequencies(config).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["cos_sin", "cos_sin_positions", "inv_freq"])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 16), (8, 8, 32)], ids=str)
def test_rotary_matches_reference(heads, mode, dtype):
    from kernels.rotary import rotary_cos_sin_ref, rotary_embedding_, rotary_embedding_ref

    num_q, num_kv, head_dim = heads
    positions = torch.tensor([0, 1, 15, 16, 17, 300, 4097], device=DEVICE)
    num_tokens = positions.shape[0]
    # q and k as the model has them: strided views into one fused projection output.
    qkv = randn(num_tokens, (num_q + 2 * num_kv) * head_dim, dtype=dtype)
    q = qkv[:, : num_q * head_dim].view(num_tokens, num_q, head_dim)
    k = qkv[:, num_q * head_dim: (num_q + num_kv) * head_dim].view(num_tokens, num_kv, head_dim)
    v_before = qkv[:, (num_q + num_kv) * head_dim:].clone()
    inv_freq = llama3_inv_freq(head_dim)
    if mode == "inv_freq":
        angles = {"positions": positions, "inv_freq": inv_freq}
    elif mode == "cos_sin_positions":
        cos, sin = rotary_cos_sin_ref(torch.arange(4100, device=DEVICE), inv_freq)
        angles = {"cos": cos, "sin": sin, "positions": positions}
    else:
        cos, sin = rotary_cos_sin_ref(positions, inv_freq)
        angles = {"cos": cos, "sin": sin}
    ref_q, ref_k = rotary_embedding_ref(q, k, **angles)
    out_q, out_k = rotary_embedding_(q, k, **angles)
    assert out_q is q and out_k is k
    assert_matches(q, ref_q)
    assert_matches(k, ref_k)
    assert torch.equal(qkv[:, (num_q + num_kv) * head_dim:], v_before), "v was touched"


# --- SwiGLU --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 2 * 1536), (1, 2 * 100), (3, 2, 2 * 64)], ids=str)
def test_silu_and_mul_matches_reference(shape, dtype):
    from kernels.swiglu import silu_and_mul, silu_and_mul_ref

    gate_up = randn(*shape, dtype=dtype) * 3
    with poisoned_allocations():
        out = silu_and_mul(gate_up)
    assert_matches(out, silu_and_mul_ref(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 2 * 640), (1, 2 * 100)], ids=str)
def test_gelu_tanh_and_mul_matches_reference(shape, dtype):
    from kernels.swiglu import gelu_tanh_and_mul, gelu_tanh_and_mul_ref

    gate_up = randn(*shape, dtype=dtype) * 3
    with poisoned_allocations():
        out = gelu_tanh_and_mul(gate_up)
    assert_matches(out, gelu_tanh_and_mul_ref(gate_up))


# --- KV cache write ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", [(3, 64, 16), (1, 128, 8), (8, 32, 5)], ids=str)
def test_write_kv_cache_matches_reference(layout, dtype):
    from kernels.kv_cache import write_kv_cache, write_kv_cache_ref

    num_kv, head_dim, block_size = layout
    cache = torch.full((2, 7, block_size, num_kv, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    ref = cache.clone()
    # Slots on both sides of block boundaries, out of order.
    slots = torch.tensor([0, block_size - 1, block_size, 3 * block_size + 1, 7 * block_size - 1, 2],
                         device=DEVICE)
    kv = randn(slots.shape[0], 2 * num_kv * head_dim + 3, dtype=dtype)  # strided k and v views
    k = kv[:, : num_kv * head_dim].view(-1, num_kv, head_dim)
    v = kv[:, num_kv * head_dim: 2 * num_kv * head_dim].view(-1, num_kv, head_dim)
    write_kv_cache(k, v, cache, slots)
    write_kv_cache_ref(k, v, ref, slots)
    assert torch.equal(cache.isnan(), ref.isnan()), "written slots differ"
    assert torch.equal(cache.nan_to_num(0.0), ref.nan_to_num(0.0))


# --- INT8 weight-only matmul ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mnk", [(1, 576, 576), (7, 1536, 576), (33, 100, 130)], ids=str)
def test_int8_matmul_matches_reference(mnk, dtype):
    from kernels.int8_matmul import int8_matmul, int8_matmul_ref, quantize_int8_ref

    m, n, k = mnk
    weight, scale = quantize_int8_ref(randn(n, k, seed=5))
    x = randn(m, k, dtype=dtype, seed=6)
    scale = scale.to(dtype)
    with poisoned_allocations():
        out = int8_matmul(x, weight, scale)
    assert_matches(out, int8_matmul_ref(x, weight, scale))


# --- Launcher checks -----------------------------------------------------------------------------

def test_launchers_reject_bad_arguments():
    from kernels.int8_matmul import int8_matmul
    from kernels.kv_cache import write_kv_cache
    from kernels.rms_norm import fused_add_rms_norm, rms_norm
    from kernels.rotary import rotary_embedding_
    from kernels.swiglu import silu_and_mul

    x = randn(4, 64)
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(x, randn(32), 1e-6)
    with pytest.raises(ValueError, match="dtype"):
        rms_norm(x, randn(64, dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        rms_norm(randn(64, 4).t(), randn(4), 1e-6)
    with pytest.raises(ValueError, match="residual must have shape"):
        fused_add_rms_norm(x, randn(3, 64), randn(64), 1e-6)
    with pytest.raises(ValueError, match="even dimension"):
        silu_and_mul(randn(4, 7))
    with pytest.raises(ValueError, match="int8"):
        int8_matmul(x, randn(8, 64), randn(8))
    with pytest.raises(ValueError, match="weight must have shape"):
        int8_matmul(x, torch.zeros(8, 32, dtype=torch.int8, device=DEVICE), randn(8))
    q, k = randn(3, 4, 16), randn(3, 2, 16)
    with pytest.raises(ValueError, match="cos must have shape"):
        rotary_embedding_(q, k, cos=randn(3, 16), sin=randn(3, 8))
    with pytest.raises(ValueError, match="positions and inv_freq"):
        rotary_embedding_(q, k)
    cache = torch.zeros(2, 4, 16, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping must have shape"):
        write_kv_cache(k, k, cache, torch.zeros(2, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="kv_cache must be"):
        write_kv_cache(k, k, cache[:1], torch.zeros(3, dtype=torch.long, device=DEVICE))


# --- Dispatch ------------------------------------------------------------------------------------

def test_select_ops_picks_the_side_for_the_device_and_honours_the_override(monkeypatch):
    from kernels.ops import CPU_OPS, TORCH_OPS, TRITON_OPS, select_ops
    from model.attention import CpuPagedAttention, TorchPagedAttention, TritonPagedAttention, attention_for

    from kernels import cpu_extension

    monkeypatch.delenv("LADDER_KERNELS", raising=False)
    monkeypatch.setattr(cpu_extension, "ENABLED", True)  # LADDER_CPU_KERNELS, as read at import
    assert select_ops("cpu") is CPU_OPS and select_ops("meta") is TORCH_OPS
    monkeypatch.setattr(cpu_extension, "ENABLED", False)  # LADDER_CPU_KERNELS=0
    assert select_ops("cpu") is TORCH_OPS
    monkeypatch.setattr(cpu_extension, "ENABLED", True)
    backends = {ops.name: type(attention_for(ops, 16, None)) for ops in (TORCH_OPS, CPU_OPS, TRITON_OPS)}
    assert backends == {"torch": TorchPagedAttention, "cpu": CpuPagedAttention, "triton": TritonPagedAttention}
    expected_on_cuda = TORCH_OPS if INTERPRETING else TRITON_OPS
    assert select_ops("cuda") is expected_on_cuda
    monkeypatch.setenv("LADDER_KERNELS", "torch")
    assert select_ops("cuda") is TORCH_OPS
    monkeypatch.setenv("LADDER_KERNELS", "triton")
    assert select_ops(DEVICE) is TRITON_OPS
    monkeypatch.setenv("LADDER_KERNELS", "cuda-graphs")
    with pytest.raises(ValueError, match="expected torch, triton or auto"):
        select_ops("cpu")
