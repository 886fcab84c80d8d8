#!/usr/bin/env bash
# The kernels on a CUDA GPU, in one command: their tests compiled (no interpreter), then the roofline
# benchmark at realistic sizes against eager torch and torch.compile. Written for an H200.
#
#   benchmarks/gpu_kernels.sh
#   PYTHON=/opt/venv/bin/python OUT=/tmp/results BENCH_ARGS="--no-compile" benchmarks/gpu_kernels.sh
#
# PYTHON   interpreter to use (default: the repository's .venv, else python3). It needs a CUDA build of
#          torch 2.13 with triton 3.9.0, and the test extras (pip install -e '.[test]').
# OUT      directory for the results (default: out/gpu-kernels-<UTC time>): versions.txt, tests.log,
#          tests.xml, bench.txt, bench.json.
# BENCH_ARGS  extra arguments for benchmarks/kernel_bench.py (e.g. --only decode_attention,int8_matmul).
#
# Exit status: 0 only if the tests and the benchmark both succeeded; the results are kept either way.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
python=${PYTHON:-}
if [[ -z $python ]]; then
  if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi
out=${OUT:-$repo/out/gpu-kernels-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$out"
# Compiled kernels and the automatic choice of ops: nothing inherited may force the interpreter.
unset TRITON_INTERPRET LADDER_KERNELS
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}

echo "== versions"
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv,noheader \
    2>/dev/null || echo "nvidia-smi: not available"
  "$python" - <<'PY'
import sys

import torch

print("python", sys.version.split()[0], "at", sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "cuda available:", torch.cuda.is_available())
try:
    import triton
    print("triton", triton.__version__)
except ImportError as exc:
    print("triton: not importable:", exc)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB")
PY
} 2>&1 | tee "$out/versions.txt"

"$python" - <<'PY'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("torch sees no CUDA device: install a CUDA build (torch==2.13.0 from download.pytorch.org) on a GPU machine")
from kernels.runtime import HAS_TRITON, INTERPRETING, TRITON_IMPORT_ERROR

if not HAS_TRITON:
    sys.exit(f"triton is not importable ({TRITON_IMPORT_ERROR}): pip install triton==3.9.0")
if INTERPRETING:
    sys.exit("TRITON_INTERPRET is set: the kernels would be interpreted, not compiled")
from kernels.ops import TRITON_OPS, select_ops

assert select_ops("cuda") is TRITON_OPS, "a CUDA model does not pick the Triton kernels"
print("kernels: compiled Triton, picked for CUDA models")
PY

echo "== kernel tests (compiled)"
tests_rc=0
"$python" -m pytest -q -rs -p no:cacheprovider --junitxml "$out/tests.xml" \
  tests/kernels/test_kernels.py tests/kernels/test_kernels_attention.py tests/kernels/test_kernels_model.py \
  tests/kernels/test_kernels_compile.py \
  2>&1 | tee "$out/tests.log" || tests_rc=$?

echo "== benchmark (realistic sizes)"
bench_rc=0
# shellcheck disable=SC2086  # BENCH_ARGS is a list of words on purpose
"$python" benchmarks/kernel_bench.py --out "$out/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.txt" || bench_rc=$?

echo "== summary"
echo "tests: $(tail -n 1 "$out/tests.log") (exit $tests_rc)"
if [[ -s $out/bench.json ]]; then
  "$python" - "$out/bench.json" <<'PY'
import json
import sys

report = json.load(open(sys.argv[1]))
print(f"{report['device']}: copy {report['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s, "
      f"{report['dtype']} matmul {report['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s, triton {report['triton_mode']}")
print(f"{'kernel':<20} {'size':<30} {'triton ms':>9} {'x eager':>8} {'x compile':>9} {'roof':>6}  bound")
for r in report["results"]:
    t, roof = r["times_ms"], r["roof_fraction"]["triton"]
    def speedup(base):
        return f"{t[base] / t['triton']:.2f}" if t["triton"] and t[base] else "-"
    print(f"{r['kernel']:<20} {r['size']:<30} {t['triton'] or float('nan'):9.3f} {speedup('eager'):>8} "
          f"{speedup('compile'):>9} {'-' if roof is None else f'{100 * roof:.0f}%':>6}  {r['bound']}")
PY
else
  echo "benchmark: no results (exit $bench_rc)"
fi
echo "results in $out"
exit $((tests_rc != 0 || bench_rc != 0))
