#!/usr/bin/env bash
# On a CUDA machine: compile the default model with torch-compile (CUDA graphs) in bf16, fp16 and int8
# for --device cuda, then print one table of parity and decode speed against eager fp32 on the same GPU
# (issue 7's GPU check: single-stream decode >= 1,000 tok/s in 16-bit, perplexity within the bounds).
# Results go under $OUT (default /tmp/ladder-gpu-compile). Usage: bash benchmarks/gpu_compile.sh
set -euo pipefail
OUT=${OUT:-/tmp/ladder-gpu-compile}
PYTHON=${PYTHON:-python}
mkdir -p "$OUT"
dirs=()
for precision in bf16 fp16 int8; do
  dir="$OUT/torch-compile-$precision"
  rm -rf "$dir"
  "$PYTHON" -m ladder.cli compile --backend torch-compile --precision "$precision" --device cuda \
    --out "$dir" 2>&1 | grep -v Warning | tail -12 || true
  [ -d "$dir" ] && dirs+=("$dir")
done
[ ${#dirs[@]} -gt 0 ] && "$PYTHON" -m compile.report "${dirs[@]}" 2>"$OUT/report.json" | tee "$OUT/report.md"
