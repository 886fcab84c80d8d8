"""An embedding table kept as a GGUF file's quantized rows, dequantized row by row as tokens look them up.

Under W4A8 the token embedding of a quantized file is one too (its LM head reads the same blocks as W4A8 rows):
a float32 table of 262,144 x 640 (Gemma 3 270M) is 0.67 GB, as Q8_0 blocks 0.18 GB; a 31B's is 5.6 GB.

Gemma 4's small models carry a per-layer embedding table of vocabulary x layers x 256 values (E2B: 262,144 x
8,960, 2.3 billion values: 9.4 GB in float32, about 1.3 GB as Q4_K blocks). A step reads one row per token, so
the table stays as the file's blocks (a view of its memory map: pages the kernel may share and drop) and
only the rows of the step's tokens are dequantized, by the same `gguf` dequantizer the float readers use:
the values are those a float table read from the file would hold.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import nn

Q8_0 = 8  # GGML's type number: the token embedding's type in many files, dequantized here in torch


def q8_0_rows(rows: torch.Tensor, width: int) -> torch.Tensor:
    """rows [T, width / 32 * 34] uint8 of Q8_0 blocks (a float16 scale d, then 32 int8 codes q) -> [T, width]
    float32 d * q: the gguf package's product (both factors float32), bit for bit, in less of its time (one
    row 20 us against 33, a 512-token prompt's rows 0.19 ms against 1.6; a float table's lookup is 5 us)."""
    blocks = rows.view(len(rows), width // 32, 34)
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # [T, blocks, 1]
    return (blocks[..., 2:].view(torch.int8).float() * d).reshape(len(rows), width)


class BlockEmbedding(nn.Module):
    def __init__(self, blocks: np.ndarray, qtype: int, width: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        """blocks [rows, bytes per row] uint8: each row's quantized blocks of `qtype` (a GGML type), `width`
        values a row; lookups come back as `dtype` on `device`."""
        super().__init__()
        self.qtype, self.width = qtype, width
        self.dtype, self.out_device = dtype, torch.device(device)
        with warnings.catch_warnings():  # the map is read-only, and only read: torch warns that it is
            warnings.simplefilter("ignore", UserWarning)
            self.blocks = torch.from_numpy(np.asarray(blocks))  # a view of the same pages, not a copy

    @classmethod
    def of(cls, table, dtype: torch.dtype, device: torch.device | str = "cpu") -> BlockEmbedding:
        """Over a GGUF file's table (a gguf ReaderTensor of a quantized type: its shape is [width, rows])."""
        return cls(table.data, table.tensor_type, int(table.shape[0]), dtype, device)

    @property
    def num_embeddings(self) -> int:
        return self.blocks.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, width]
        rows = self.blocks.index_select(0, ids.cpu())  # [T, bytes per row], copied out of the map
        if len(rows) == 0:
            return torch.empty(0, self.width, dtype=self.dtype, device=self.out_device)
        if self.qtype == Q8_0:
            values = q8_0_rows(rows, self.width)
        else:
            from gguf.quants import dequantize  # the reader's package, imported where a file's table is used

            values = torch.from_numpy(np.ascontiguousarray(
                dequantize(rows.numpy(), self.qtype).reshape(len(rows), self.width), dtype=np.float32))
        return values.to(self.out_device, self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.width}, blocks of type {self.qtype}"
