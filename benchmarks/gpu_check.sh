#!/usr/bin/env bash
# The device check in one command (benchmarks/gpu_check.py says what it runs): Triton kernels against
# their references in fp16/bf16 with their share of the copy bandwidth, decode tok/s of a model with
# SmolLM2-135M's shapes (eager bf16, torch-compile with CUDA graphs, TensorRT when installed) at batch 1
# and 64, and fp32 logits parity of the GPU model against the CPU. Needs torch with CUDA and Triton;
# nothing from the network, no model files.
#
#   benchmarks/gpu_check.sh              on a machine with one NVIDIA GPU (at most 5 minutes)
#   benchmarks/gpu_check.sh --dry-run    anywhere: the same code on CPU tensors, tiny shapes, Triton interpreted
#   benchmarks/gpu_check.sh --sections bandwidth,kernels,parity   then   --sections decode   (two shorter runs)
#   (--budget-s S: seconds the check plans for; decode batch sizes that would not fit are skipped, with the reason)
#
# OUT      directory for gpu_check.json, gpu_check.txt, versions.txt and log.txt
#          (default: benchmarks/results/gpu-check)
# PYTHON   interpreter (default: the repository's .venv when it has one, else python3)
# GPU_CHECK_TIMEOUT  seconds before the check is sent SIGTERM (default 280); it then writes what it has
#          and exits, and is killed 20 s later if it has not
#
# Exit status: 0 when every kernel and the parity check pass; 124 when stopped by the timeout. The
# results are written after every section, and on the timeout's SIGTERM, so a stopped run keeps them.
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

limit=${GPU_CHECK_TIMEOUT:-280}
rc=0
# SIGTERM first: Python's handler writes the figures so far (gpu_check.json, gpu_check.txt); SIGKILL only
# if it has not exited 20 s later.
timeout -s TERM -k 20 "$limit" "$python" benchmarks/gpu_check.py "$@" --out "$out" 2>&1 | tee "$out/log.txt" \
  || rc=${PIPESTATUS[0]}
if ((rc == 124 || rc == 137)); then
  echo "gpu_check: stopped after $limit s (exit $rc); partial results kept" | tee -a "$out/log.txt"
fi
echo "results in $out"
exit "$rc"
