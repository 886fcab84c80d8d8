#!/usr/bin/env bash
# Soak `ladder serve` at ~80% of its measured capacity (30 minutes unless --minutes M), then SIGKILL it
# under load and restart it. Writes benchmarks/results/soak/soak.json and soak.png; exits non-zero if a
# check fails. Other options: --model PATH, --load FRACTION, --out DIR, --no-kill (benchmarks/soak.py -h).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" benchmarks/soak.py "$@"
