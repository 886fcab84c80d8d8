#!/usr/bin/env bash
# The decode-first prefill budget (`ladder serve --max-prefill-tokens`) swept in one run: one server per
# budget, one after the other, the same closed-loop workload at each concurrency; prints TTFT and TPOT
# percentiles and output tok/s per budget and writes prefill_budget.json.
#
#   benchmarks/prefill_budget.sh [--budgets 64,128,256,512,2048] [--concurrency 16,32]
#                                [--requests-per-user 2] [--input-len 128] [--output-len 128] [--out DIR]
#                                [-- ladder serve args]
#
# A budget >= --max-num-batched-tokens (2048 by default) means no bound: prompts take the whole step.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
LADDER=${LADDER:-$ROOT/.venv/bin/ladder}
BUDGETS=64,128,256,512,2048
CONCURRENCY=16,32
PER_USER=2
INPUT_LEN=128
OUTPUT_LEN=128
OUT=benchmarks/results/prefill_budget
PORT=${PORT:-8093}
LADDER_ARGS=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --budgets) BUDGETS=$2; shift 2 ;;
    --concurrency) CONCURRENCY=$2; shift 2 ;;
    --requests-per-user) PER_USER=$2; shift 2 ;;
    --input-len) INPUT_LEN=$2; shift 2 ;;
    --output-len) OUTPUT_LEN=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --) shift; LADDER_ARGS=("$@"); break ;;
    *) echo "prefill_budget.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
IFS=, read -r -a SIZES <<< "$BUDGETS"
IFS=, read -r -a LEVELS <<< "$CONCURRENCY"

source benchmarks/server_wait.sh
require_free_port "$PORT"

for budget in "${SIZES[@]}"; do
  "$LADDER" serve --port "$PORT" --max-prefill-tokens "$budget" "${LADDER_ARGS[@]}" > "$OUT/serve-$budget.log" 2>&1 &
  SERVER=$!
  trap 'kill $SERVER 2> /dev/null || true' EXIT
  wait_ready "http://127.0.0.1:$PORT/ready" $SERVER
  for users in "${LEVELS[@]}"; do
    "$LADDER" loadtest --base-url "http://127.0.0.1:$PORT" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
      --max-concurrency "$users" --num-requests $((users * PER_USER)) --warmup "$users" --seed 0 --quiet \
      --out "$OUT/b$budget-c$users" > "$OUT/b$budget-c$users.txt"
    echo "  budget $budget, concurrency $users done (load average $(cut -d' ' -f1 /proc/loadavg))"
  done
  kill $SERVER; wait $SERVER 2> /dev/null || true
done

"$PY" - "$OUT" "$BUDGETS" "$CONCURRENCY" <<'EOF'
import json, sys
from pathlib import Path

out, budgets, levels = Path(sys.argv[1]), sys.argv[2].split(","), sys.argv[3].split(",")
rows = []
print("| concurrency | --max-prefill-tokens | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | ok/failed |")
print("|---|---|---|---|---|---|---|---|")
for users in levels:
    for budget in budgets:
        s = json.loads((out / f"b{budget}-c{users}" / "results.json").read_text())["points"][0]["summary"]
        row = {"concurrency": int(users), "max_prefill_tokens": int(budget), "output_tok_s": s["output_throughput"],
               "ttft_p50_ms": s["ttft_ms"]["median"], "ttft_p99_ms": s["ttft_ms"]["p99"],
               "tpot_p50_ms": s["tpot_ms"]["median"], "tpot_p99_ms": s["tpot_ms"]["p99"],
               "ok": s["num_ok"], "failed": s["num_failed"]}
        rows.append(row)
        print(f"| {users} | {budget} | {row['output_tok_s']:.1f} | {row['ttft_p50_ms']:,.0f} | {row['ttft_p99_ms']:,.0f} | "
              f"{row['tpot_p50_ms']:.1f} | {row['tpot_p99_ms']:.1f} | {row['ok']}/{row['failed']} |")
(out / "prefill_budget.json").write_text(json.dumps(rows, indent=1) + "\n")
print(f"wrote {out / 'prefill_budget.json'}")
EOF
