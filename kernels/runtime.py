"""Where Triton comes from, whether its kernels compile or interpret, and the launchers' argument checks.

Triton decides between compiling a kernel and running it under its interpreter when the kernel is
decorated, from the environment variable TRITON_INTERPRET. Without CUDA a compiled kernel can never run,
so on such a machine this module sets TRITON_INTERPRET=1 (unless the user chose a value) before it
imports Triton; every kernel file imports this module before it defines a kernel.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # triton is optional: the plain-torch references need nothing from it
    triton = None
    tl = None
    TRITON_IMPORT_ERROR: str | None = f"{type(exc).__name__}: {exc}"
else:
    TRITON_IMPORT_ERROR = None

HAS_TRITON = triton is not None


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:  # Triton's own reading of the variable
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# Fixed when the kernels are decorated (on import); changing the variable later has no effect on them.
INTERPRETING = HAS_TRITON and _interpreting()


def require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError(
            f"Triton is not importable ({TRITON_IMPORT_ERROR}); install it (pip install triton) "
            "or run the plain-torch kernels with LADDER_KERNELS=torch"
        )


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    ndim: int | None = None,
    shape: Iterable[int | None] | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    unit_last_stride: bool = True,
) -> None:
    """Raise ValueError naming `name` if t has the wrong rank, shape (None = any size), dtype or layout
    (TypeError if it is not a tensor at all)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {list(t.shape)}")
    if shape is not None:
        want = list(shape)
        if len(want) != t.dim() or any(w is not None and w != s for w, s in zip(want, t.shape)):
            shown = ["*" if w is None else w for w in want]
            raise ValueError(f"{name} must have shape {shown}, got {list(t.shape)}")
    if dtypes is not None:
        allowed = tuple(dtypes)
        if t.dtype not in allowed:
            names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
            raise ValueError(f"{name} must have dtype in ({names}), got {str(t.dtype).removeprefix('torch.')}")
    if unit_last_stride and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {list(t.stride())}")


def check_devices(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device, and one Triton can reach: CUDA when compiling, any when interpreting."""
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        where = ", ".join(f"{name} on {t.device}" for name, t in tensors.items())
        raise ValueError(f"tensors must share one device, got {where}")
    device = devices.pop()
    if not INTERPRETING and device.type != "cuda":
        raise ValueError(
            f"compiled Triton kernels need CUDA tensors, got tensors on {device} "
            "(set TRITON_INTERPRET=1 before importing ladder to run the kernels interpreted)"
        )
    return device


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def dot_dtype(dtype: torch.dtype):
    """The Triton dtype to feed `tl.dot` for operands of `dtype`.

    The interpreter computes bfloat16 arithmetic on the raw bits, so there bfloat16 operands are widened
    to float32 (exact: every bfloat16 is a float32); compiled kernels use the tensor cores' own type.
    """
    if dtype == torch.bfloat16:
        return tl.float32 if INTERPRETING else tl.bfloat16
    return {torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def dot_precision(dtype: torch.dtype) -> str:
    """float32 operands are multiplied exactly ("ieee"), not rounded to TF32 as Triton would by default."""
    return "ieee" if dtype == torch.float32 else "tf32"
