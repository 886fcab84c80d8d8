#!/usr/bin/env bash
# The device check in one command (benchmarks/gpu_check.py says what it runs): Triton kernels against
# their references in fp16/bf16 with their share of the copy bandwidth, decode tok/s of a model with
# SmolLM2-135M's shapes (eager bf16, torch-compile with CUDA graphs, TensorRT when installed) at batch 1
# and 64, and fp32 logits parity of the GPU model against the CPU. Needs torch with CUDA and Triton;
# nothing from the network, no model files.
#
#   benchmarks/gpu_check.sh              on a machine with one NVIDIA GPU (about 5 minutes)
#   benchmarks/gpu_check.sh --dry-run    anywhere: the same code on CPU tensors, tiny shapes, Triton interpreted
#
# OUT      directory for gpu_check.json, gpu_check.txt, versions.txt and log.txt
#          (default: benchmarks/results/gpu-check)
# PYTHON   interpreter (default: the repository's .venv when it has one, else python3)
# GPU_CHECK_TIMEOUT  seconds before the check is stopped (default 480)
#
# Exit status: 0 when every kernel and the parity check pass; the results are written either way.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
python=${PYTHON:-}
if [[ -z $python ]]; then
  if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi
out=${OUT:-$repo/benchmarks/results/gpu-check}
mkdir -p "$out"
dry_run=0
for arg in "$@"; do
  [[ $arg == --dry-run ]] && dry_run=1
done
if ((dry_run)); then
  export TRITON_INTERPRET=1 LADDER_KERNELS=triton
else
  # Compiled kernels and the automatic choice of ops: nothing inherited may force the interpreter.
  unset TRITON_INTERPRET LADDER_KERNELS
fi
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv,noheader \
    2>/dev/null || echo "nvidia-smi: not available"
  "$python" -c 'import sys, torch; print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda, "| available", torch.cuda.is_available())'
} >"$out/versions.txt" 2>&1
cat "$out/versions.txt"

rc=0
timeout "${GPU_CHECK_TIMEOUT:-480}" "$python" benchmarks/gpu_check.py "$@" --out "$out" 2>&1 | tee "$out/log.txt" \
  || rc=${PIPESTATUS[0]}
if ((rc == 124)); then
  echo "gpu_check: stopped after ${GPU_CHECK_TIMEOUT:-480} s" | tee -a "$out/log.txt"
fi
echo "results in $out"
exit "$rc"
