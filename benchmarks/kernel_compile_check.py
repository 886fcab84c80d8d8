"""Compile every kernel for a CUDA GPU on a machine without one: `python benchmarks/kernel_compile_check.py`.

The interpreter runs a kernel's Python, not its compilation, so errors only the compiler sees (a
non-constexpr global, a dot below the minimum tile, too much shared memory) would wait for a GPU. This
tool runs each launcher on small CPU tensors with the launch intercepted, turns the captured arguments
into a signature, and compiles it through Triton's CUDA backend down to a cubin (ptxas ships with
Triton). It must run in its own process: the kernels have to be decorated for compilation, not for
the interpreter.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if "kernels.runtime" in sys.modules:
    raise RuntimeError("the compile check must run in its own process (python benchmarks/kernel_compile_check.py)")
os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, for its packages

import torch  # noqa: E402

from kernels import decode_attention, int8_matmul, kv_cache, prefill_attention, rms_norm, rotary, swiglu  # noqa: E402
from kernels.runtime import HAS_TRITON, require_triton, triton  # noqa: E402

KERNEL_MODULES = (rms_norm, rotary, swiglu, kv_cache, decode_attention, prefill_attention, int8_matmul)
TYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
              torch.int32: "i32", torch.int8: "i8"}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def exercise_launchers(dtype: torch.dtype) -> None:
    """Call every launcher once per code path (modes, splits, windows, tile choices)."""
    x, w = torch.randn(4, 576, dtype=dtype), torch.randn(576, dtype=dtype)
    rms_norm.rms_norm(x, w, 1e-5)
    rms_norm.fused_add_rms_norm(x, x, w, 1e-5)
    q, k = torch.randn(3, 9, 64, dtype=dtype), torch.randn(3, 3, 64, dtype=dtype)
    rotary.rotary_embedding_(q, k, cos=torch.randn(3, 32), sin=torch.randn(3, 32))
    rotary.rotary_embedding_(q, k, positions=torch.arange(3), inv_freq=torch.randn(32))
    swiglu.silu_and_mul(torch.randn(3, 2 * 1536, dtype=dtype))
    cache = torch.randn(2, 8, 16, 3, 64, dtype=dtype)
    kv_cache.write_kv_cache(k, k, cache, torch.arange(3))
    seq_lens, tables = torch.tensor([5, 40, 100]), torch.zeros(3, 8, dtype=torch.long)
    decode_attention.paged_decode_attention(q, cache, seq_lens, tables, 100, 0.125, None, 1)
    decode_attention.paged_decode_attention(q, cache, seq_lens, tables, 100, 0.125, 20, 3)
    query_start = torch.tensor([0, 1, 2, 3])
    for max_query_len in (1, 20, 70):
        prefill_attention.paged_prefill_attention(q, cache, query_start, seq_lens, tables, max_query_len, 0.125)
    prefill_attention.paged_prefill_attention(q, cache, query_start, seq_lens, tables, 70, 0.125, 20)
    for m, n in ((1, 300), (1, 9000), (32, 300), (200, 300)):
        int8_matmul.int8_matmul(torch.randn(m, 576, dtype=dtype), torch.zeros(n, 576, dtype=torch.int8),
                                torch.randn(n, dtype=dtype))


def capture_launches(dtypes: list[torch.dtype]) -> list[tuple]:
    """(kernel, signature, constexprs, options) of every launch the launchers make, deduplicated."""
    from triton.runtime.jit import JITFunction

    launches: list[tuple] = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    original_run = JITFunction.run
    JITFunction.run = record
    # The launchers insist on CUDA tensors when compiling; here nothing runs, so CPU tensors do.
    checks = {m: m.check_devices for m in KERNEL_MODULES}
    for m in KERNEL_MODULES:
        m.check_devices = lambda **tensors: next(iter(tensors.values())).device
    try:
        for dtype in dtypes:
            exercise_launchers(dtype)
    finally:
        JITFunction.run = original_run
        for m, check in checks.items():
            m.check_devices = check

    unique, seen = [], set()
    for fn, args, kwargs in launches:
        options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages") if key in kwargs}
        values = dict(zip(fn.arg_names, args)) | kwargs
        signature, constexprs = {}, {}
        for name, param in zip(fn.arg_names, fn.params):
            value = values[name]
            if param.is_constexpr:
                signature[name], constexprs[name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[name] = "*" + TYPE_NAMES[value.dtype]
            elif isinstance(value, bool):
                signature[name] = "i1"
            elif isinstance(value, int):
                signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            elif isinstance(value, float):
                signature[name] = "fp32"
            else:
                raise TypeError(f"{fn.__name__}: cannot type argument {name}={value!r}")
        key = (fn.__name__, str(signature), str(constexprs), str(options))
        if key not in seen:
            seen.add(key)
            unique.append((fn, signature, constexprs, options))
    return unique


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/kernel_compile_check.py", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability as one number (90: H100/H200)")
    parser.add_argument("--dtypes", default="bf16,fp16,fp32", help="activation dtypes to compile for")
    args = parser.parse_args(argv)
    require_triton()
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", args.arch, 32)
    dtypes = [DTYPES[name.strip()] for name in args.dtypes.split(",")]
    failures = 0
    for fn, signature, constexprs, options in capture_launches(dtypes):
        shown = {k: str(v).removeprefix("triton.language.") for k, v in constexprs.items() if k.isupper()}
        start = time.perf_counter()
        try:
            compiled = triton.compile(triton.compiler.ASTSource(fn, signature, constexprs), target=target,
                                      options=options)
        except Exception as exc:  # noqa: BLE001  report every failing kernel, not just the first
            failures += 1
            print(f"FAIL {fn.__name__} {shown}\n     {type(exc).__name__}: {exc}")
            continue
        print(f"ok   {fn.__name__:<22} {time.perf_counter() - start:5.1f}s shared {compiled.metadata.shared:>6} B  "
              f"{shown}")
    print(f"{'all kernels compiled' if not failures else f'{failures} failed'} for sm_{args.arch}")
    return 1 if failures else 0


if __name__ == "__main__":
    if not HAS_TRITON:
        sys.exit("triton is not importable")
    sys.exit(main())
