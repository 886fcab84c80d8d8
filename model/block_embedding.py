"""An embedding table kept as a GGUF file's quantized rows, dequantized row by row as tokens look them up.

Gemma 4's small models carry a per-layer embedding table of vocabulary x layers x 256 values (E2B: 262,144 x
8,960, 2.3 billion values: 9.4 GB in float32, about 1.3 GB as Q4_K blocks). A step reads one row per token, so
the table stays as the file's blocks (a view of its memory map: pages the kernel may share and drop) and
only the rows of the step's tokens are dequantized, by the same `gguf` dequantizer the float readers use:
the values are those a float table read from the file would hold.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class BlockEmbedding(nn.Module):
    def __init__(self, blocks: np.ndarray, qtype: int, width: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        """blocks [rows, bytes per row] uint8: each row's quantized blocks of `qtype` (a GGML type), `width`
        values a row; lookups come back as `dtype` on `device`."""
        super().__init__()
        self.blocks, self.qtype, self.width = blocks, qtype, width
        self.dtype, self.out_device = dtype, torch.device(device)

    @property
    def num_embeddings(self) -> int:
        return self.blocks.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, width]
        from gguf.quants import dequantize  # the reader's package, imported where a file's table is used

        rows = self.blocks[ids.cpu().numpy()]  # [T, bytes per row], copied out of the map
        values = dequantize(rows, self.qtype).reshape(len(rows), self.width)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(self.out_device, self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.width}, blocks of type {self.qtype}"
