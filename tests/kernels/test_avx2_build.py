"""The C++ kernels' AVX2 code paths, built on an AVX-512 machine (LADDER_CPU_CFLAGS=-mno-avx512f) and run
through their own tests in a child process: the tiles, the gated activations' vector exp, the sampler's
draw, the decode attention's AVX2 task, the gated delta rule's decode step and the one-call decoder step, as
an AVX2-only host (an AMD EPYC Zen 3) runs them. Where the machine has no AVX-512 the suite's own run covers these
paths already."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import cpu_decode_attention

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not cpu_decode_attention.has_avx512(), reason="no AVX-512 build here: the suite runs AVX2 already")
def test_the_avx2_build_passes_the_kernel_and_step_tests():
    env = {**os.environ, "LADDER_CPU_CFLAGS": "-mno-avx512f"}
    check = "from kernels import cpu_w4a8_linear as w, cpu_decode_attention as a; " \
            "print(w.has_vnni(), w.has_int8_tiles(), a.has_avx512())"
    built = subprocess.run([sys.executable, "-c", check], check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=900)
    assert built.stdout.split() == ["False", "True", "False"], built.stderr[-2000:]
    tests = ["tests/kernels/test_cpu_fused_ops.py", "tests/kernels/test_cpu_w4a8_linear.py",
             "tests/kernels/test_cpu_w8a8_linear.py", "tests/kernels/test_cpu_sampling.py",
             "tests/kernels/test_cpu_decode_attention.py", "tests/kernels/test_cpu_w4a8_experts.py",
             "tests/kernels/test_gated_delta.py",
             "tests/model/test_cpu_step.py"]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", *tests],
                         check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:]
