"""What the kernel tests share: the device they run on, the dtypes and tolerances, and NaN-poisoned
allocations, so that an element a kernel leaves unwritten fails the comparison."""

from __future__ import annotations

import contextlib

import torch

from kernels.runtime import INTERPRETING

DEVICE = "cpu" if INTERPRETING or not torch.cuda.is_available() else "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.shape, ref.dtype)
    assert not out.isnan().any(), "NaN in the kernel's output (an element left unwritten?)"
    err = relative_error(out, ref)
    assert err < TOLERANCE[ref.dtype], f"relative error {err:.2e} for {ref.dtype}"


@contextlib.contextmanager
def poisoned_allocations():
    """Inside, torch.empty and torch.empty_like return floating tensors full of NaN."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = lambda *a, **k: poison(real_empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(real_empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)
