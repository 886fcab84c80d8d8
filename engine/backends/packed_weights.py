"""The CPU kernels' packed int8 weight layouts, stored in a CPU artifact so loading need not pack again.

INT8 and W8A8 linears keep their weights as int8 [N, K] (`model.safetensors`) and derive the layout their
C++ kernel reads at load (`Int8Weights.pack`: the interleaved int8 blocks, and W8A8's per-column sums).
For the default model that packing costs seconds at every start (over 20 s on a busy machine), so
`ladder compile` stores its result in `packed.safetensors` (safetensors, listed and checksummed in the
manifest like every file). The layout belongs to the kernels' code: the file records a digest of their
source, and a file from other kernel code is ignored (the weights are packed again, as before).
"""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path

from torch import nn

from kernels import cpu_int8_linear, cpu_w8a8_linear
from model.quantization import Int8Weights

PACKED = "packed.safetensors"
DERIVED = ("packed", "wsum")  # the buffers `pack()` sets; persistent=False, so not in model.safetensors


def layout_key() -> str:
    """A digest of the code that defines the packed layouts (the kernels' modules, C++ source included)."""
    digest = hashlib.sha256()
    for module in (cpu_int8_linear, cpu_w8a8_linear):
        digest.update(inspect.getsource(module).encode())
    return digest.hexdigest()


def _derived(module: nn.Module) -> dict[str, object]:
    return {f"{name}.{buffer}": getattr(sub, buffer) for name, sub in module.named_modules()
            if isinstance(sub, Int8Weights) for buffer in DERIVED if getattr(sub, buffer, None) is not None}


def save_packed(module: nn.Module, directory: Path) -> list[str]:
    """Write the packed layouts of `module`'s int8 linears (already packed); none: no file."""
    from safetensors.torch import save_file

    tensors = {name: t.contiguous() for name, t in _derived(module).items()}
    if not tensors:
        return []
    save_file(tensors, str(Path(directory) / PACKED), metadata={"layout": layout_key()})
    return [PACKED]


def load_packed(module: nn.Module, directory: Path) -> bool:
    """Set the int8 linears' packed buffers from the artifact's file; False (nothing set) when there is
    none, or it was written for other kernel code, or it does not cover every linear."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(directory) / PACKED
    if not path.is_file():
        return False
    with safe_open(str(path), "pt") as f:
        if (f.metadata() or {}).get("layout") != layout_key():
            return False
    tensors = load_file(str(path))
    wanted = {f"{name}.{buffer}" for name, sub in module.named_modules() if isinstance(sub, Int8Weights)
              for buffer in DERIVED if hasattr(sub, buffer)}
    if set(tensors) != wanted:
        return False
    for key, tensor in tensors.items():
        name, _, buffer = key.rpartition(".")
        setattr(module.get_submodule(name), buffer, tensor)
    return True
