#!/usr/bin/env bash
# Schemathesis over the server's own OpenAPI schema: >= 1,000 generated cases per operation (-n), no 5xx
# allowed, every response checked against the schema; sampling floats drawn from the edges of float
# arithmetic (benchmarks/schemathesis_hooks.py). Serves a tiny random model with SmolLM2's real
# tokenizer and chat template (every server path is real; generation is fast), or --model PATH.
# Usage: benchmarks/schemathesis.sh [-n CASES] [--model PATH]. Report: benchmarks/results/schemathesis/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
CASES=1000
MODEL=""
while [ $# -gt 0 ]; do
  case "$1" in
    -n) CASES="$2"; shift 2 ;;
    --model) MODEL="$2"; shift 2 ;;
    *) echo "schemathesis.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
OUT=benchmarks/results/schemathesis
mkdir -p "$OUT"
WORK="$(mktemp -d)"
trap 'kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; rm -rf "$WORK"' EXIT
if [ -z "$MODEL" ]; then
  MODEL="$WORK/tiny-chat"
  "$PY" -c "import sys; sys.path.insert(0, 'tests/support'); from pathlib import Path; from tiny_models import make_tiny_chat_model; make_tiny_chat_model(Path('$MODEL'))" >/dev/null 2>&1
fi
PORT="${PORT:-8937}"
"$PY" -m ladder.cli serve --model "$MODEL" --port "$PORT" --max-model-len 256 --kv-cache-memory 0.02 \
  --log-level info >"$OUT/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null && break
  kill -0 "$SERVER" 2>/dev/null || { echo "the server exited; see $OUT/server.log" >&2; exit 1; }
  sleep 0.5
done
START=$(date +%s)
ROOT="$(pwd)"
ST="$(cd "$(dirname "$PY")" && pwd)/st"
set +e
# Run from the scratch directory: schemathesis keeps a cache directory in its working directory.
# benchmarks/schemathesis_hooks.py redraws the sampling floats from their edges (subnormals, 1e-300, ...).
(cd "$WORK" && SCHEMATHESIS_HOOKS=schemathesis_hooks PYTHONPATH="$ROOT/benchmarks" "$ST" run "http://127.0.0.1:$PORT/openapi.json" -n "$CASES" --seed 0 \
  --checks not_a_server_error,response_schema_conformance,content_type_conformance,negative_data_rejection \
  --suppress-health-check all --request-timeout 120 --workers 2 --continue-on-failure --generation-database none \
  --report junit --report-dir "$ROOT/$OUT") | tee "$OUT/summary.txt"
STATUS=${PIPESTATUS[0]}
set -e
echo "schemathesis: exit $STATUS in $(( $(date +%s) - START )) s; server still alive: $(kill -0 "$SERVER" 2>/dev/null && echo yes || echo no)"
# Requests the server answered, per operation and status class, from its access log.
echo "requests served (operation, status class, count):"
grep -oE '"(GET|POST|PUT|DELETE|PATCH|HEAD|OPTIONS) [^ ?"]+[^"]*" [0-9]{3}' "$OUT/server.log" \
  | sed -E 's/^"([A-Z]+) ([^ ?]+)[^"]*" ([0-9])[0-9]{2}$/\1 \2 \3xx/' | sort | uniq -c | sort -k2,3
exit "$STATUS"
