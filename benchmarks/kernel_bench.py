"""Roofline benchmark of the kernels against their eager and torch.compile references, in one run.

    .venv/bin/python benchmarks/kernel_bench.py [--quick] [--full] [--only NAME,...] [--no-compile] [--out results.json]

For each kernel and size it prints the time of the Triton kernel, of the eager reference and of
torch.compile of the reference, the bytes each must move and the FLOPs it does, and the fraction of the
device's roof it reaches: the copy bandwidth for memory-bound work, the matmul rate for compute-bound
work (both measured in the same run; the bound is whichever the arithmetic intensity hits first).
On a CUDA device the sizes are realistic (Llama-3-8B-like); elsewhere they are small unless --full, and
the Triton column is empty when Triton can only interpret (the interpreter's time means nothing).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, for its packages

from kernel_cases import Case, make_cases  # noqa: E402
from kernels.runtime import HAS_TRITON, INTERPRETING, triton  # noqa: E402
from kernels.timing import time_calls  # noqa: E402


@dataclass
class Result:
    kernel: str
    size: str
    dtype: str
    bytes: int
    flops: int
    bound: str  # "memory" or "compute"
    times_ms: dict[str, float | None] = field(default_factory=dict)  # triton, eager, compile
    roof_fraction: dict[str, float | None] = field(default_factory=dict)
    rel_error: float | None = None
    notes: list[str] = field(default_factory=list)


def measure_ms(fn: Callable[[], object], device: torch.device, target_s: float) -> float:
    """Median milliseconds per call over 5 samples, each a loop of calls sized to take about target_s / 5."""
    return time_calls(fn, min_reps=5, sample_time=target_s / 5, device=device).median_ms


def copy_bandwidth(device: torch.device, num_bytes: int, target_s: float) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    ms = measure_ms(lambda: dst.copy_(src), device, target_s)
    return 2 * src.numel() * 4 / (ms * 1e-3)


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, target_s: float) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    ms = measure_ms(lambda: a @ b, device, target_s)
    return 2 * n**3 / (ms * 1e-3)


def relative_error(out, ref) -> float:
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    num = sum((o.double() - r.double()).norm() ** 2 for o, r in zip(outs, refs))
    den = sum(r.double().norm() ** 2 for r in refs)
    return (num / den).sqrt().item()


def time_implementations(case: Case, device: torch.device, use_triton: bool, use_compile: bool, target_s: float,
                         result: Result) -> None:
    """Fill result.times_ms (and rel_error when the kernel runs); the inputs are freed on return."""
    inputs = case.make_inputs(device)
    result.times_ms["triton"] = None
    if use_triton:
        # Check before timing; the in-place kernels get fresh inputs so the reference sees the same ones.
        result.rel_error = relative_error(case.kernel_fn(**case.make_inputs(device)),
                                          case.ref_fn(**case.make_inputs(device)))
        result.times_ms["triton"] = measure_ms(lambda: case.kernel_fn(**inputs), device, target_s)
    result.times_ms["eager"] = measure_ms(lambda: case.ref_fn(**inputs), device, target_s)
    result.times_ms["compile"] = None
    if use_compile:
        try:
            compiled = torch.compile(case.ref_fn, dynamic=False)
            result.times_ms["compile"] = measure_ms(lambda: compiled(**inputs), device, target_s)
        except Exception as exc:  # noqa: BLE001  a baseline that fails to build is reported, not fatal
            result.notes.append(f"torch.compile failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")


def run_case(case: Case, device: torch.device, roofs: tuple[float, float], use_triton: bool, use_compile: bool,
             target_s: float) -> Result:
    bandwidth, rate = roofs
    intensity = case.flops / max(case.bytes, 1)
    bound = "compute" if intensity > rate / bandwidth else "memory"
    result = Result(case.kernel, case.size, str(case.dtype).removeprefix("torch."), case.bytes, case.flops, bound)
    time_implementations(case, device, use_triton, use_compile, target_s, result)
    for name, ms in result.times_ms.items():
        if ms is None:
            result.roof_fraction[name] = None
        elif bound == "memory":
            result.roof_fraction[name] = case.bytes / (ms * 1e-3) / bandwidth
        else:
            result.roof_fraction[name] = case.flops / (ms * 1e-3) / rate
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def format_table(results: list[Result], triton_note: str) -> str:
    def ms(v):
        return f"{v:9.3f}" if v is not None else f"{'-':>9}"

    def pct(v):
        return f"{100 * v:5.1f}%" if v is not None else f"{'-':>6}"

    def ratio(a, b):
        return f"{b / a:6.2f}x" if a and b else f"{'-':>7}"

    head = (f"{'kernel':<20} {'size':<28} {'triton ms':>9} {'eager ms':>9} {'compile ms':>10} {'vs eager':>8} "
            f"{'vs comp.':>8} {'MB':>9} {'GFLOP':>8} {'bound':>7} {'roof: triton':>12} {'eager':>6} {'comp.':>6} "
            f"{'rel err':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        t = r.times_ms
        lines.append(
            f"{r.kernel:<20} {r.size:<28} {ms(t['triton'])} {ms(t['eager'])} {ms(t['compile']):>10} "
            f"{ratio(t['triton'], t['eager']):>8} {ratio(t['triton'], t['compile']):>8} {r.bytes / 1e6:9.2f} "
            f"{r.flops / 1e9:8.3f} {r.bound:>7} {pct(r.roof_fraction['triton']):>12} "
            f"{pct(r.roof_fraction['eager'])} {pct(r.roof_fraction['compile'])} "
            f"{'-' if r.rel_error is None else f'{r.rel_error:.1e}':>8}"
        )
        lines.extend(f"    note: {n}" for n in r.notes)
    lines.append(triton_note)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="benchmarks/kernel_bench.py", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (the default without CUDA)")
    parser.add_argument("--full", action="store_true", help="realistic sizes even without CUDA")
    parser.add_argument("--only", default="", help="comma-separated kernel names to run")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument("--seconds", type=float, default=None, help="target timing per measurement")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", default=None, help="write the results as JSON to this path")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    quick = args.quick or (device.type != "cuda" and not args.full)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target_s = args.seconds if args.seconds is not None else (0.25 if quick else 0.5)
    use_triton = HAS_TRITON and not INTERPRETING and device.type == "cuda"
    if not HAS_TRITON:
        triton_mode, triton_note = "absent", "triton: not installed; only the torch reference and torch.compile ran"
    elif not use_triton:
        triton_mode = "interpreter"
        triton_note = ("triton: interpreter only on this machine; kernel times not measured "
                       "(torch reference and torch.compile only)")
    else:
        triton_mode, triton_note = "compiled", f"triton {triton.__version__}: compiled kernels"

    cases = make_cases(quick, dtype)
    if args.only:
        wanted = {name.strip() for name in args.only.split(",")}
        unknown = wanted - {c.kernel for c in cases}
        if unknown:
            parser.error(f"unknown kernel(s) {sorted(unknown)}; choose from {sorted({c.kernel for c in cases})}")
        cases = [c for c in cases if c.kernel in wanted]

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    copy_bytes = (1 << 30) if device.type == "cuda" and not quick else (64 << 20)
    bandwidth = copy_bandwidth(device, copy_bytes, target_s)
    rate = matmul_rate(device, dtype, 8192 if device.type == "cuda" and not quick else 1024, target_s)
    print(f"device: {name} ({device.type}), torch {torch.__version__}, sizes: {'quick' if quick else 'full'}, "
          f"dtype {str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} CPU threads")
    print(f"measured copy bandwidth {bandwidth / 1e9:.1f} GB/s, {str(dtype).removeprefix('torch.')} matmul "
          f"{rate / 1e12:.2f} TFLOP/s (ridge {rate / bandwidth:.1f} FLOP/byte)\n")

    results = []
    for case in cases:
        result = run_case(case, device, (bandwidth, rate), use_triton, not args.no_compile, target_s)
        results.append(result)
        print(f"  done {case.kernel} {case.size}", flush=True)
    print()
    print(format_table(results, triton_note))
    if quick:
        print("quick sizes fit in the caches: fractions of the copy bandwidth (a DRAM figure) may pass 100%")
    if args.out:
        report = {
            "device": name, "device_type": device.type, "torch": torch.__version__,
            "triton": triton.__version__ if HAS_TRITON else None, "triton_mode": triton_mode,
            "sizes": "quick" if quick else "full", "dtype": str(dtype).removeprefix("torch."),
            "copy_bandwidth_bytes_per_s": bandwidth, "matmul_flops_per_s": rate,
            "results": [asdict(r) for r in results],
        }
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
