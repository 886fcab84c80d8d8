"""LADDER_CPU_KERNELS=0, read once at import: the C++ extension is never loaded, no C++ kernel is registered,
every CPU op runs its torch reference, and the model's ops are the plain-torch ones."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SWITCHED_OFF = r"""
import torch

from kernels import cpu_extension, cpu_fused_ops, cpu_int8_linear, cpu_w4a8_linear, cpu_w8a8_linear
from kernels.ops import TORCH_OPS, select_ops
from kernels.rms_norm import rms_norm_ref
from parallel import shared_memory_all_reduce

assert not cpu_extension.cpu_kernels_enabled() and cpu_extension.load() is None
assert not cpu_int8_linear.available() and not shared_memory_all_reduce.available()
assert select_ops("cpu") is TORCH_OPS
gen = torch.Generator().manual_seed(0)
x = torch.randn(5, 64, generator=gen)
w = torch.randint(-127, 128, (40, 64), dtype=torch.int8, generator=gen)
scale = torch.rand(40, generator=gen) / 100
packed = cpu_int8_linear.pack(w)
with torch.inference_mode():
    out = cpu_int8_linear.int8_linear(x, packed, scale, None, 40)
assert torch.equal(out, cpu_int8_linear.int8_linear_ref(x, packed, scale, None, 40))
packed, wsum = cpu_w8a8_linear.pack(w)
assert torch.equal(cpu_w8a8_linear.w8a8_linear(x, packed, wsum, scale, None, 40),
                   cpu_w8a8_linear.w8a8_matmul_ref(x, w, scale))
codes = torch.randint(0, 16, (40, 64), dtype=torch.uint8, generator=gen)
d = torch.rand(40, 2, generator=gen).half() / 100
codes_packed, scales = cpu_w4a8_linear.pack(codes, d, None, 4)
assert torch.equal(cpu_w4a8_linear.w4a8_linear(x, codes_packed, scales, None, 40, 8),
                   cpu_w4a8_linear.w4a8_matmul_ref(x, codes, d.float(), None, 8))
weight = torch.randn(64, generator=gen)
assert torch.equal(cpu_fused_ops.rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5))
for name in ("int8_linear", "w8a8_linear", "w4a8_linear", "paged_decode_attention", "rms_norm"):
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"ladder::{name}", "CPU"), name
print("switched off")
"""


def test_switched_off_cpu_kernels_run_the_torch_references():
    env = {**os.environ, "LADDER_CPU_KERNELS": "0"}
    proc = subprocess.run([sys.executable, "-c", SWITCHED_OFF], cwd=Path(__file__).resolve().parents[2], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and "switched off" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]

