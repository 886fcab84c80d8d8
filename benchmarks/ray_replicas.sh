#!/usr/bin/env bash
# One process against Ray Serve replicas, in one run: `ladder serve` (one engine, all cores) and
# `ladder serve --ray --replicas N` (N engines of cores/N threads each) up side by side, the same
# closed-loop load sent to each in turn (--rounds times, medians), then a shared-prefix workload (several
# prefixes taking turns) through Ray with the router's prefix hit rate read from its /metrics. Prints a
# table and writes ray_replicas.json.
#
#   benchmarks/ray_replicas.sh [--replicas 2] [--concurrency 32] [--requests-per-user 2] [--rounds 2]
#                              [--input-len 96] [--output-len 32] [--prefix-len 256] [--num-prefixes 8]
#                              [--prefix-requests 192] [--one-threads N] [--out DIR]
#                              [-- ladder serve args for both]
#
# --one-threads N runs the single process with N torch threads (OMP_NUM_THREADS) instead of one per core:
# on a machine whose cores other work oversubscribes, threads of one process wait for each other at every
# parallel region, which replicas of one thread each never do.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
LADDER=${LADDER:-$ROOT/.venv/bin/ladder}
REPLICAS=2
CONCURRENCY=32
PER_USER=2
ROUNDS=2
INPUT_LEN=96
OUTPUT_LEN=32
PREFIX_LEN=256
NUM_PREFIXES=8
PREFIX_REQUESTS=192
OUT=benchmarks/results/ray_replicas
PORT_ONE=${PORT_ONE:-8094}
PORT_RAY=${PORT_RAY:-8095}
LADDER_ARGS=(--kv-cache-memory 1)
ONE_THREADS=
while [[ $# -gt 0 ]]; do
  case $1 in
    --replicas) REPLICAS=$2; shift 2 ;;
    --concurrency) CONCURRENCY=$2; shift 2 ;;
    --requests-per-user) PER_USER=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --input-len) INPUT_LEN=$2; shift 2 ;;
    --output-len) OUTPUT_LEN=$2; shift 2 ;;
    --prefix-len) PREFIX_LEN=$2; shift 2 ;;
    --num-prefixes) NUM_PREFIXES=$2; shift 2 ;;
    --prefix-requests) PREFIX_REQUESTS=$2; shift 2 ;;
    --one-threads) ONE_THREADS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --) shift; LADDER_ARGS=("$@"); break ;;
    *) echo "ray_replicas.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"

source benchmarks/server_wait.sh
require_free_port "$PORT_ONE" "$PORT_RAY"

env ${ONE_THREADS:+OMP_NUM_THREADS=$ONE_THREADS} "$LADDER" serve --port "$PORT_ONE" "${LADDER_ARGS[@]}" \
  > "$OUT/serve-one.log" 2>&1 &
ONE=$!
"$LADDER" serve --ray --replicas "$REPLICAS" --port "$PORT_RAY" "${LADDER_ARGS[@]}" > "$OUT/serve-ray.log" 2>&1 &
RAY=$!
# SIGTERM: `ladder serve --ray` shuts Serve and its local Ray instance down.
trap 'kill $ONE $RAY 2> /dev/null || true; wait $ONE $RAY 2> /dev/null || true' EXIT
wait_ready "http://127.0.0.1:$PORT_ONE/ready" $ONE
wait_ready "http://127.0.0.1:$PORT_RAY/ready" $RAY

load() {  # port name [loadtest args]
  local port=$1 name=$2; shift 2
  "$LADDER" loadtest --base-url "http://127.0.0.1:$port" --max-concurrency "$CONCURRENCY" --seed 0 --quiet \
    --out "$OUT/$name" "$@" > "$OUT/$name.txt"
  cut -d' ' -f1 /proc/loadavg > "$OUT/$name.loadavg"
  echo "  $name done (load average $(cat "$OUT/$name.loadavg"))"
}

SAME=(--input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --num-requests $((CONCURRENCY * PER_USER))
      --warmup "$CONCURRENCY")
for round in $(seq 1 "$ROUNDS"); do
  load "$PORT_ONE" "one-r$round" "${SAME[@]}"
  curl -sf "http://127.0.0.1:$PORT_RAY/metrics" > "$OUT/ray-r$round.before"
  load "$PORT_RAY" "ray-r$round" "${SAME[@]}"
  curl -sf "http://127.0.0.1:$PORT_RAY/metrics" > "$OUT/ray-r$round.after"
done
curl -sf "http://127.0.0.1:$PORT_RAY/metrics" > "$OUT/router-before.txt"
load "$PORT_RAY" prefix --prefix-len "$PREFIX_LEN" --num-prefixes "$NUM_PREFIXES" --input-len 32 --output-len 16 \
  --num-requests "$PREFIX_REQUESTS"
curl -sf "http://127.0.0.1:$PORT_RAY/metrics" > "$OUT/router-after.txt"

"$PY" - "$OUT" "$ROUNDS" "$REPLICAS" "$CONCURRENCY" "$PREFIX_LEN" "$NUM_PREFIXES" "${ONE_THREADS:-0}" <<'PYEOF'
import json, statistics, sys
from pathlib import Path

out, rounds, replicas, users, prefix_len, num_prefixes, one_threads = Path(sys.argv[1]), *map(int, sys.argv[2:])


def summary(name):
    s = json.loads((out / name / "results.json").read_text())["points"][0]["summary"]
    return {"output_tok_s": s["output_throughput"], "ttft_p50_ms": s["ttft_ms"]["median"],
            "tpot_p50_ms": s["tpot_ms"]["median"], "ok": s["num_ok"], "failed": s["num_failed"],
            "loadavg": float((out / f"{name}.loadavg").read_text())}


def samples(name):
    """The router's /metrics samples as saved in `name`: {"metric{labels}": value}."""
    values = {}
    for line in (out / name).read_text().splitlines():
        if line.startswith("ladder_router_"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


def split(name):
    """Requests each replica took during one Ray round, largest first: how evenly the router spread it."""
    def per_replica(path):
        return {k: v for k, v in samples(path).items() if k.startswith("ladder_router_replica_requests_total{")}
    before, after = per_replica(f"{name}.before"), per_replica(f"{name}.after")
    return sorted((int(after[k] - before.get(k, 0.0)) for k in after), reverse=True)


def counters(name):
    return {k: v for k, v in samples(name).items() if "{" not in k}


runs = {kind: [summary(f"{kind}-r{r}") for r in range(1, rounds + 1)] for kind in ("one", "ray")}
for r, run in enumerate(runs["ray"], 1):
    run["split"] = split(f"ray-r{r}")
ratios = [ray["output_tok_s"] / one["output_tok_s"] for one, ray in zip(runs["one"], runs["ray"])]
before, after = counters("router-before.txt"), counters("router-after.txt")
routed = {k.removeprefix("ladder_router_").removesuffix("_total"): after[k] - before.get(k, 0.0)
          for k in after if k.endswith("_total")}
hit_rate = routed["prefix_hits"] / routed["requests"] if routed["requests"] else 0.0
prefix = summary("prefix")

print(f"| server | round | output tok/s | TTFT p50 ms | TPOT p50 ms | ok/failed | load avg | requests per replica |")
print("|---|---|---|---|---|---|---|---|")
one_label = f"ladder serve (1 process, {one_threads} thread(s))" if one_threads else "ladder serve (1 process)"
for kind, label in (("one", one_label), ("ray", f"ladder serve --ray --replicas {replicas}")):
    for r, s in enumerate(runs[kind], 1):
        print(f"| {label} | {r} | {s['output_tok_s']:.1f} | {s['ttft_p50_ms']:,.0f} | {s['tpot_p50_ms']:.1f} | "
              f"{s['ok']}/{s['failed']} | {s['loadavg']:.2f} | {'/'.join(map(str, s.get('split', []))) or '-'} |")
print(f"\nconcurrency {users}: Ray/one output tok/s ratio per round {', '.join(f'{x:.2f}' for x in ratios)}; "
      f"median {statistics.median(ratios):.2f}")
print(f"shared-prefix workload ({num_prefixes} prefixes of {prefix_len} tokens): {int(routed['requests'])} routed, "
      f"{int(routed['prefix_matches'])} found their prefix on a live replica, {int(routed['prefix_hits'])} went "
      f"there; hit rate {hit_rate:.1%} (first sightings count as misses); "
      f"{prefix['output_tok_s']:.1f} output tok/s, {prefix['ok']}/{prefix['failed']} ok/failed")
result = {"replicas": replicas, "concurrency": users, "one_threads": one_threads or None, "runs": runs,
          "ratios": ratios, "median_ratio": statistics.median(ratios),
          "prefix_workload": {"num_prefixes": num_prefixes, "prefix_len": prefix_len, "routed": routed,
                              "hit_rate": hit_rate, "summary": prefix}}
(out / "ray_replicas.json").write_text(json.dumps(result, indent=2) + "\n")
print(f"wrote {out / 'ray_replicas.json'}")
PYEOF
