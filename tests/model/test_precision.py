"""The one vocabulary of precisions: every option, the manifest and the cost model read the same table."""

import pytest
import torch

from model.precision import (
    COMPILE_PRECISIONS,
    DTYPE_CHOICES,
    FLOAT_PRECISIONS,
    PRECISIONS,
    QUANTIZATIONS,
    parse_dtype,
    precision,
    precision_of_dtype,
)


def test_the_option_vocabularies_come_from_the_table():
    assert COMPILE_PRECISIONS == ("fp32", "fp16", "bf16", "int8", "w8a8")
    assert QUANTIZATIONS == ("none", "int8", "w8a8", "w4a8")
    assert set(FLOAT_PRECISIONS) == {"fp32", "fp16", "bf16"}
    assert set(DTYPE_CHOICES) == {"fp32", "fp16", "bf16", "float32", "float16", "bfloat16"}
    for p in PRECISIONS.values():
        assert p.quantized == (p.name not in FLOAT_PRECISIONS)
        assert p.matmul in ("fp32", "bf16", "int8")
        if p.quantized:  # int8 linears keep float32 activations and cache on a CPU
            assert p.dtype == torch.float32


@pytest.mark.parametrize("name, dtype", [("fp32", torch.float32), ("float32", torch.float32),
                                         ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16),
                                         ("fp16", torch.float16), ("float16", torch.float16),
                                         (torch.bfloat16, torch.bfloat16)])
def test_parse_dtype_takes_either_name(name, dtype):
    assert parse_dtype(name) == dtype


def test_unknown_names_say_what_exists():
    with pytest.raises(ValueError, match=r"unknown dtype 'int8' \(choose from fp32, fp16, bf16, float32"):
        parse_dtype("int8")
    with pytest.raises(ValueError, match=r"unknown precision 'fp8' \(choose from fp32, .*w4a8\)"):
        precision("fp8")


def test_precision_of_dtype_round_trips():
    for name, dtype in FLOAT_PRECISIONS.items():
        assert precision_of_dtype(dtype) == name
    assert precision_of_dtype(torch.int8) == "int8"  # outside the float table: torch's own name


def test_cost_model_reads_the_table():
    from doctor.cost import ModelCost
    from model.config import ModelConfig

    config = ModelConfig("llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                         max_position_embeddings=128, tie_word_embeddings=True)
    fp32, w4a8 = ModelCost(config, "fp32", 4), ModelCost(config, "w4a8", 4)
    assert w4a8.weight_bytes / fp32.weight_bytes == pytest.approx(0.625 / 4)
    assert w4a8.matmul_kind == "int8"
    with pytest.raises(ValueError, match="unknown precision 'int4'"):
        ModelCost(config, "int4", 4)
