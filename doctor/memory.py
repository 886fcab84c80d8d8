"""Where the process's resident memory goes, for the model the doctor loaded: its weights (by kind), the KV cache,
the model file's pages still mapped, and the rest (torch and the other libraries, the tokenizer, the allocator's
free pieces), from /proc/self/status beside the tensors' own bytes.

The weights count each storage once (a tied LM head is the embedding) and only CPU tensors: on a GPU the
process's resident memory holds none of them. Linux only (elsewhere: None)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

# A weight's kind by the module that holds it (the last matching part of its name).
KINDS = (("embed_tokens", "embedding"), ("lm_head", "LM head"), ("self_attn", "attention"), ("mlp", "MLP / experts"),
         ("experts", "MLP / experts"), ("router", "MLP / experts"))


@dataclass(frozen=True)
class MemoryUse:
    resident: int  # bytes: VmRSS
    peak: int  # VmHWM: the most the process has held (the load's float weights before quantization)
    anonymous: int  # RssAnon: the heap (tensors, libraries' data)
    file_pages: int  # RssFile: mapped files' pages (the model file, shared libraries)
    weights: dict[str, int]  # kind -> bytes of CPU tensors
    kv_cache: int  # bytes of CPU KV cache tensors

    @property
    def rest(self) -> int:
        """The heap beside the weights and the KV cache: torch, the libraries, the tokenizer, freed pieces."""
        return max(self.anonymous - sum(self.weights.values()) - self.kv_cache, 0)

    def to_dict(self) -> dict:
        return {**asdict(self), "rest": self.rest}


def kind_of(name: str) -> str:
    parts = name.split(".")
    for part in reversed(parts):
        for key, kind in KINDS:
            if part == key:
                return kind
    return "other"


def weight_bytes(module: nn.Module) -> dict[str, int]:
    """The module's CPU parameters and buffers, each storage once, by kind."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    for name, tensor in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        if tensor is None or tensor.device.type != "cpu" or tensor.is_meta:
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        kind = kind_of(name)
        out[kind] = out.get(kind, 0) + storage.nbytes()
    return out


def measure_memory(module: nn.Module, kv_caches: list[torch.Tensor]) -> MemoryUse | None:
    """The process's memory now, the model's share of it itemized; None where /proc/self/status is missing."""
    status = Path("/proc/self/status")
    if not status.is_file():
        return None
    fields = {}
    for line in status.read_text().splitlines():
        key, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            fields[key] = int(value.split()[0]) * 1024
    kv = sum(t.untyped_storage().nbytes() for t in kv_caches if t.device.type == "cpu")
    return MemoryUse(fields.get("VmRSS", 0), fields.get("VmHWM", 0), fields.get("RssAnon", 0),
                     fields.get("RssFile", 0), weight_bytes(module), kv)
