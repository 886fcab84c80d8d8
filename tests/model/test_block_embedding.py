"""model/block_embedding.py: a GGUF file's quantized rows looked up as the float table the gguf package would
dequantize, bit for bit: Q8_0 through its own torch path (the token embedding of many files), other types
through the gguf package; each as the given dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quantize
from gguf.quants import dequantize

from model.block_embedding import Q8_0, BlockEmbedding


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.F16])
def test_rows_are_the_gguf_packages_values(qtype):
    rng = np.random.default_rng(0)
    table = (rng.standard_normal((50, 96)) * np.exp(rng.uniform(-12, 4, (50, 1)))).astype(np.float32)
    table[3] = 0.0  # a zero scale
    table[4, :32] = 6e4  # a scale at float16's top
    blocks = quantize(table, qtype)  # [rows, bytes per row] uint8 (float16 values for F16)
    blocks = blocks.view(np.uint8).reshape(len(table), -1)
    embedding = BlockEmbedding(blocks, int(qtype), 96, torch.float32)
    ids = torch.tensor([0, 3, 4, 49, 3, 17])
    expected = torch.from_numpy(dequantize(blocks, qtype).reshape(len(table), 96).astype(np.float32))[ids]
    assert torch.equal(embedding(ids), expected)
    assert embedding(ids[:1]).shape == (1, 96) and embedding(ids[:0]).shape == (0, 96)
    assert embedding(ids).dtype == torch.float32 and BlockEmbedding(blocks, int(qtype), 96, torch.bfloat16)(ids).dtype \
        == torch.bfloat16
    assert Q8_0 == int(GGMLQuantizationType.Q8_0)
