"""Attention backends over the paged KV cache: one interface (base.py), one file per backend, and one way
to give a model its backend (install.py).

- TorchPagedAttention (torch_backend.py): the plain-torch reference; runs anywhere and defines what the
  others compute.
- CpuPagedAttention (cpu_backend.py): every token of a chunk up to 1,024 tokens as a row of the C++ decode
  kernel (batch-invariant bits), longer chunks through the reference.
- OpaquePagedAttention (opaque_backend.py): the CPU attention behind one custom op, for compiled CPU steps.
- TritonPagedAttention (triton_backend.py): the Triton decode and prefill kernels, launched per layer.
- GraphPagedAttention (graph_backend.py): the Triton kernels behind one custom op, for compiled steps
  replayed as CUDA graphs.
- ExportPagedAttention (export_backend.py): the reference with a functional cache update, for export.
"""

from __future__ import annotations

from model.attention.base import BaseAttention
from model.attention.cpu_backend import CpuAttentionPlan, CpuPagedAttention
from model.attention.export_backend import ExportPagedAttention
from model.attention.graph_backend import GraphAttentionPlan, GraphPagedAttention, triton_paged_attention
from model.attention.install import BACKENDS, attention_for, install, installed, wrapped
from model.attention.opaque_backend import OpaquePagedAttention, paged_attention_op
from model.attention.torch_backend import TorchAttentionPlan, TorchPagedAttention
from model.attention.triton_backend import TritonPagedAttention
from model.attention_metadata import AttentionMetadata

AttentionBackend = BaseAttention  # the name the model's layers are typed with
# What a backend's plan() returns.
AttentionPlan = TorchAttentionPlan | CpuAttentionPlan | GraphAttentionPlan | AttentionMetadata

__all__ = [
    "BACKENDS", "AttentionBackend", "AttentionPlan", "BaseAttention", "CpuAttentionPlan", "CpuPagedAttention",
    "ExportPagedAttention", "GraphAttentionPlan", "GraphPagedAttention", "OpaquePagedAttention", "TorchAttentionPlan",
    "TorchPagedAttention", "TritonPagedAttention", "attention_for", "install", "installed", "paged_attention_op",
    "triton_paged_attention", "wrapped",
]
