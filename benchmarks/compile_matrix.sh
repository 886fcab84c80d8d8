#!/usr/bin/env bash
# Compile the default model with every backend and precision that runs on this machine, then print one
# table of the parity reports and decode speeds (each artifact's own benchmark stage, eager fp32 measured
# in the same process). Usage: bash benchmarks/compile_matrix.sh [OUT_DIR]
set -euo pipefail
OUT=${1:-benchmarks/results/artifacts}
LADDER=${LADDER:-.venv/bin/ladder}
PYTHON=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
builds=("torch-compile w8a8" "torch-compile int8" "torch-compile fp32" "torch-compile bf16" "torch-compile fp16" "onnx fp32" "onnx int8" "onnx fp16")
dirs=()
for build in "${builds[@]}"; do
  read -r backend precision <<<"$build"
  dir="$OUT/$backend-$precision"
  rm -rf "$dir"
  "$LADDER" compile --backend "$backend" --precision "$precision" --out "$dir" 2>&1 | grep -v Warning | tail -12
  dirs+=("$dir")
done
"$PYTHON" -m compile.report "${dirs[@]}" 2>"$OUT/report.json" | tee "$OUT/report.md"
