#!/usr/bin/env bash
# Every figure of a host that the one-stream work asks for, in one run, for benchmarks/RESULTS.md: the host
# (lscpu), `ladder doctor` on the default model (its batch-1 step against the copy bandwidth), ladder against
# llama.cpp's server at 1, 4, 16 and 32 users, the copying and the free chat workloads with and without
# `--speculative-tokens 8`, the KV cache dtypes' batch-32 step, and 1B-parameter Q4_K_M and Q5_K_M models
# (benchmarks/synthetic_gguf.py) against llama.cpp. Each part that fails is noted and the rest still runs.
#
#   benchmarks/host_report.sh [--out DIR] [--quick]
#
# --quick: one user, short answers, a 2-layer synthetic model: checks that every part runs (minutes), no
# figures to keep. Without it, about 30-40 minutes on 2 cores. llama.cpp is built as peer_llamacpp.sh builds
# it (LLAMACPP_NATIVE=OFF and LLAMACPP_AMX=OFF unless set: a KVM guest's AMX crashed ggml, and a native build
# has died with SIGILL). Results: DIR/summary.md (paste it into RESULTS.md), and each part's own files.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/host-report-$(date -u +%Y%m%dT%H%M%SZ)
QUICK=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --out) OUT=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    *) echo "host_report.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-.venv/bin/python}
LADDER=${LADDER:-.venv/bin/ladder}
export LLAMACPP_NATIVE=${LLAMACPP_NATIVE:-OFF} LLAMACPP_AMX=${LLAMACPP_AMX:-OFF}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.md
if ((QUICK)); then
  USERS=1; PER_USER=1; LEN=(--input-len 32 --output-len 16); SYNTH=(--layers 2); SPEC_USERS=1
else
  USERS=1,4,16,32; PER_USER=2; LEN=(); SYNTH=(); SPEC_USERS=1,4
fi

extract() {  # what of a part's log goes in the summary: its tables, else the doctor's step breakdown, else its end
  if grep -q -E '^\|' "$1"; then
    grep -E '^\|' "$1"
  elif grep -q 'one decode step' "$1"; then
    echo '```'; sed -n '/one decode step/,/^next step/p' "$1"; echo '```'
  else
    echo '```'; tail -n 25 "$1"; echo '```'
  fi
}

part() {  # part TITLE COMMAND...: run it, its output to a file, what `extract` finds in it to the summary
  local title=$1 log
  shift
  log=$OUT/$(echo "$title" | tr -cs 'a-zA-Z0-9' '-' | sed 's/-$//').log
  echo "== $title" | tee -a "$SUMMARY.progress"
  local start=$SECONDS
  if "$@" >"$log" 2>&1; then
    { echo; echo "### $title"; echo; echo "\`$*\` ($(date -u +%H:%M) UTC, $((SECONDS - start)) s)"; echo
      extract "$log"; } >>"$SUMMARY"
  else
    { echo; echo "### $title: FAILED (exit $?)"; echo; echo "\`$*\`, log $log"; echo; echo '```'
      tail -n 15 "$log"; echo '```'; } >>"$SUMMARY"
  fi
}

{
  echo "# Host report, $(date -u +%Y-%m-%d) ($(git rev-parse --short HEAD 2>/dev/null || echo unknown))"
  echo
  echo '```'
  lscpu | grep -E '^(Model name|Vendor ID|CPU family|Model:|CPU\(s\)|Thread|Core|Socket|L1d|L2|L3|Hypervisor)'
  echo "ISA: $(grep -o -w -E 'avx2|fma|f16c|avx512f|avx512bw|avx512_vnni|avx_vnni|avx512_bf16|amx_int8' /proc/cpuinfo \
    | sort -u | tr '\n' ' ')"
  free -g | head -2
  echo '```'
} >"$SUMMARY"
lscpu >"$OUT/lscpu.txt"

part "ladder doctor, default model (batch-1 step against the copy bandwidth)" \
  "$LADDER" doctor --quiet --out "$OUT/doctor"
part "ladder against llama.cpp, random prompts" \
  benchmarks/peer_llamacpp.sh --concurrency "$USERS" --requests-per-user "$PER_USER" "${LEN[@]}" --out "$OUT/peer"
"$PY" benchmarks/speculative_bench.py --write-datasets "$OUT/datasets" >/dev/null
for workload in copy free; do
  part "ladder against llama.cpp, $workload answers, no speculation" \
    benchmarks/peer_llamacpp.sh --dataset "$OUT/datasets/$workload.jsonl" --concurrency "$SPEC_USERS" \
    --requests-per-user "$PER_USER" "${LEN[@]}" --out "$OUT/peer-$workload"
  part "ladder against llama.cpp, $workload answers, --speculative-tokens 8" \
    benchmarks/peer_llamacpp.sh --dataset "$OUT/datasets/$workload.jsonl" --concurrency "$SPEC_USERS" \
    --requests-per-user "$PER_USER" "${LEN[@]}" --out "$OUT/peer-$workload-spec" -- --speculative-tokens 8
done
part "KV cache dtypes, batch-32 decode step" \
  "$PY" benchmarks/kv_cache_dtype_bench.py --rounds "$((QUICK ? 1 : 3))" --out "$OUT/kv_cache_dtype.json"
part "a 1B-parameter Q4_K_M model (synthetic weights): writing it" \
  "$PY" benchmarks/synthetic_gguf.py "${SYNTH[@]}" --out "$OUT/llama1b-q4_k_m.gguf"
part "a 1B-parameter Q4_K_M model: ladder doctor" \
  "$LADDER" doctor --model "$OUT/llama1b-q4_k_m.gguf" --quiet --out "$OUT/doctor-1b"
part "a 1B-parameter Q4_K_M model: ladder against llama.cpp" \
  benchmarks/peer_llamacpp.sh --model "$OUT/llama1b-q4_k_m.gguf" --concurrency "$SPEC_USERS" \
  --requests-per-user "$PER_USER" "${LEN[@]}" --out "$OUT/peer-1b"
rm -f "$OUT/llama1b-q4_k_m.gguf"
part "a 1B-parameter Q5_K_M model (synthetic weights, 5-bit codes in W4A8): writing it" \
  "$PY" benchmarks/synthetic_gguf.py "${SYNTH[@]}" --preset q5_k_m --out "$OUT/llama1b-q5_k_m.gguf"
part "a 1B-parameter Q5_K_M model: ladder against llama.cpp" \
  benchmarks/peer_llamacpp.sh --model "$OUT/llama1b-q5_k_m.gguf" --concurrency "$SPEC_USERS" \
  --requests-per-user "$PER_USER" "${LEN[@]}" --out "$OUT/peer-1b-q5"
rm -f "$OUT/llama1b-q5_k_m.gguf" "$SUMMARY.progress"
echo "wrote $SUMMARY"
