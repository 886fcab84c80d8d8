"""Where a model's attention backend comes from: chosen by its ops at build time, swapped in from outside
afterwards (compiled artifacts, export, benchmarks) by `install` alone.

A decoder holds its backend twice over: `module.attention` builds each step's plan, and every attention
layer's `backend` runs it. The two must be the same object (a plan is only meaningful to the backend that
made it), which is why nothing but `install` assigns them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import nn

from kernels.ops import Ops
from model.attention.base import BaseAttention
from model.attention.cpu_backend import CpuPagedAttention
from model.attention.torch_backend import TorchPagedAttention
from model.attention.triton_backend import TritonPagedAttention

# The backend an eager model gets with each side of the kernels (kernels/ops.py `Ops.name`).
BACKENDS: dict[str, type[BaseAttention]] = {
    "torch": TorchPagedAttention, "cpu": CpuPagedAttention, "triton": TritonPagedAttention,
}


def attention_for(ops: Ops, block_size: int, sliding_window: int | None) -> BaseAttention:
    """The backend that goes with a model's ops."""
    return BACKENDS[ops.name](block_size, sliding_window)


def install(module: nn.Module, backend: BaseAttention) -> BaseAttention:
    """Give `module` (a decoder: it plans with `module.attention`) and every attention layer in it `backend`;
    returns the backend it had. Layers are found wherever they sit, so a layer wrapped from outside
    (parallel/sequence_split.py) gets it too. ValueError for a model whose layers have different windows
    (Gemma 3): one backend holds one window, and its callers plan with it alone."""
    if getattr(module, "local_attention", None) is not None:
        raise ValueError(f"{module.config.architecture} has sliding-window layers beside full-attention ones; "
                         "compiled, exported and instrumented steps take one attention window (run it eager)")
    previous = module.attention
    for sub in module.modules():
        if isinstance(getattr(sub, "backend", None), BaseAttention):
            sub.backend = backend
    module.attention = backend
    return previous


@contextlib.contextmanager
def installed(module: nn.Module, backend: BaseAttention) -> Iterator[BaseAttention]:
    """`install` for the length of a `with` block (a trace, an export); the previous backend comes back
    after it, raised or not."""
    previous = install(module, backend)
    try:
        yield backend
    finally:
        install(module, previous)


@contextlib.contextmanager
def wrapped(module: nn.Module, wrap: Callable[[BaseAttention], BaseAttention]) -> Iterator[None]:
    """Every backend of `module` (`attention`, and `local_attention` where windowed layers have their own)
    replaced by `wrap(backend)` for the length of a `with` block, in the module and in each layer that ran
    it: a wrapper that delegates to its backend keeps each layer's window (the doctor's timing)."""
    originals = {name: backend for name in ("attention", "local_attention")
                 if isinstance(backend := getattr(module, name, None), BaseAttention)}
    wrappers = {id(backend): wrap(backend) for backend in originals.values()}
    layers = [(sub, sub.backend) for sub in module.modules()
              if isinstance(getattr(sub, "backend", None), BaseAttention) and id(sub.backend) in wrappers]
    try:
        for name, backend in originals.items():
            setattr(module, name, wrappers[id(backend)])
        for sub, backend in layers:
            sub.backend = wrappers[id(backend)]
        yield
    finally:
        for name, backend in originals.items():
            setattr(module, name, backend)
        for sub, backend in layers:
            sub.backend = backend
