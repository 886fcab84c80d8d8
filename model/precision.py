"""The one vocabulary of precisions: how a model's linear weights are stored and what its matmuls compute in.

Every part names a precision from this table and reads its facts here: `ladder compile --precision`
(artifacts), `--quantization` of serve, generate, bench and doctor (a precision applied at load, or
`none` to keep the weights' dtype), `--dtype` (a float precision, torch's name for it, or `auto`,
`resolve_dtype`), the artifact manifest, the stats the server reports and `ladder doctor`'s cost model.

- fp32, fp16, bf16: float weights and activations of that type.
- int8: weight-only int8 linears (float activations), `model/quantization.py`.
- w8a8: int8 weights and per-token int8 activations, SmoothQuant-calibrated, `model/quantization.py`.
- w4a8: a GGUF file's own 4-bit and 8-bit blocks times int8 activations, `model/block_quantization.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu_extension import cpu_flags


@dataclass(frozen=True)
class Precision:
    name: str
    dtype: torch.dtype  # weights outside the quantized linears, activations and the KV cache on a CPU
    weight_bytes: float  # bytes of one linear weight (w4a8: Q4_1 blocks, 20 bytes per 32 weights)
    matmul: str  # what the linears compute in, as `ladder doctor` measures peaks: fp32, bf16 or int8
    quantized: bool  # the linears are swapped for int8 modules
    compiled: bool  # `ladder compile` builds artifacts in it
    at_load: bool  # `--quantization` applies it when the model loads


PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("fp32", torch.float32, 4, "fp32", quantized=False, compiled=True, at_load=False),
    Precision("fp16", torch.float16, 2, "bf16", quantized=False, compiled=True, at_load=False),
    Precision("bf16", torch.bfloat16, 2, "bf16", quantized=False, compiled=True, at_load=False),
    Precision("int8", torch.float32, 1, "fp32", quantized=True, compiled=True, at_load=True),
    Precision("w8a8", torch.float32, 1, "int8", quantized=True, compiled=True, at_load=True),
    Precision("w4a8", torch.float32, 0.625, "int8", quantized=True, compiled=False, at_load=True),
)}

FLOAT_PRECISIONS: dict[str, torch.dtype] = {p.name: p.dtype for p in PRECISIONS.values() if not p.quantized}
COMPILE_PRECISIONS: tuple[str, ...] = tuple(p.name for p in PRECISIONS.values() if p.compiled)
# `--quantization`: "none" keeps the weights' own dtype.
QUANTIZATIONS: tuple[str, ...] = ("none", *(p.name for p in PRECISIONS.values() if p.at_load))
# `--dtype` takes a float precision or torch's name for its dtype (serve, generate and bench also `auto`).
DTYPE_NAMES: dict[str, str] = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
DTYPE_CHOICES: tuple[str, ...] = (*FLOAT_PRECISIONS, *DTYPE_NAMES)


def precision(name: str) -> Precision:
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r} (choose from {', '.join(PRECISIONS)})")
    return PRECISIONS[name]


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A float dtype from a precision name (fp32), torch's name (float32) or the dtype itself."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = DTYPE_NAMES.get(dtype, dtype)
    if name not in FLOAT_PRECISIONS:
        raise ValueError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPE_CHOICES)})")
    return FLOAT_PRECISIONS[name]


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device) -> str | torch.dtype:
    """`auto` -> the float type to run in on `device`; any other dtype passes through, checked. Every entry
    point (EngineConfig, `model.load`, `ladder generate`) resolves through here, so they agree.

    - CUDA: bfloat16, the tensor cores' type with float32's range (float16 on a GPU without bfloat16).
    - A CPU: float32, whatever the checkpoint holds (F32, F16 or quantized GGUF blocks, a bfloat16 or
      float16 Hugging Face directory). The CPU's fast paths start from float32 weights: `--quantization
      auto` (W4A8 or W8A8, model/quantization.py) needs them and runs ahead of bfloat16 even on a CPU with
      AMX bfloat16 tiles, bfloat16 matmuls run at half the float32 rate on a CPU without such tiles
      (benchmarks/RESULTS.md, "bfloat16 decode attention on the CPU kernel"), and float16 matmuls run at
      about float32's rate on a CPU."""
    if isinstance(dtype, torch.dtype) or dtype != "auto":
        parse_dtype(dtype)
        return dtype
    if torch.device(device).type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float16"
    return "float32"


def cpu_multiplies_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (x86 AMX or AVX-512 BF16, Arm's BF16 extension):
    there bfloat16 matmuls run several times faster than float32 ones (a vision tower's, 3.3x on 2 vCPUs of
    a Xeon with AMX), elsewhere at about half their rate."""
    return bool({"amx_bf16", "avx512_bf16", "bf16"} & cpu_flags())


# `--vision-dtype`: the vision tower's float type (model/vision.py), `auto` or a float dtype by either name.
VISION_DTYPE_CHOICES: tuple[str, ...] = ("auto", *DTYPE_CHOICES)


def resolve_vision_dtype(setting: str, text_dtype: torch.dtype, device: str | torch.device) -> torch.dtype:
    """`--vision-dtype`: a float dtype as it says, or `auto`: the text model's, except bfloat16 for a float32
    model on a CPU that multiplies bfloat16 in hardware (`cpu_multiplies_bf16`). The tower is a plain vision
    transformer over every tile (hundreds of GFLOP an image) whose float32 matmuls bound the time to the
    first token; its embeddings then differ from float32's by about 0.5% (relative norm, measured on random
    weights), as they would on a GPU in bfloat16."""
    if setting != "auto":
        return parse_dtype(setting)
    if text_dtype == torch.float32 and torch.device(device).type == "cpu" and cpu_multiplies_bf16():
        return torch.bfloat16
    return text_dtype


def precision_of_dtype(dtype: torch.dtype) -> str:
    """The float precision of a dtype: torch.bfloat16 -> "bf16"; a dtype outside the table by torch's name."""
    for name, float_dtype in FLOAT_PRECISIONS.items():
        if float_dtype == dtype:
            return name
    return str(dtype).removeprefix("torch.")


# `--kv-cache-dtype`: the KV cache's element type, `auto` (the activations') or a float dtype by either name.
KV_CACHE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
KV_CACHE_DTYPE_CHOICES: tuple[str, ...] = ("auto", *DTYPE_CHOICES)


def parse_kv_cache_dtype(name: str) -> torch.dtype | None:
    """`--kv-cache-dtype` NAME -> the cache's dtype, None for auto (the activations' dtype)."""
    if name == "auto":
        return None
    if DTYPE_NAMES.get(name, name) not in FLOAT_PRECISIONS:
        raise ValueError(f"unknown KV cache dtype {name!r} (choose from {', '.join(KV_CACHE_DTYPE_CHOICES)})")
    return parse_dtype(name)
