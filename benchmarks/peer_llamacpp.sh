#!/usr/bin/env bash
# ladder serve against llama.cpp's own server, one after the other in one run, on the same GGUF file
# (the one the default model ships, or --model's), with the same closed-loop workload at each concurrency.
#
#   benchmarks/peer_llamacpp.sh [--build-only] [--model NAME_OR_GGUF] [--concurrency 1,4,16,32]
#                               [--requests-per-user 4] [--isa native|avx2]
#                               [--input-len 128] [--output-len 128] [--dataset FILE] [--out DIR]
#                               [-- ladder serve args]
#
# --model takes a packaged model's name (gemma-3-270m) or a GGUF file; by default the embedded SmolLM2.
# --dataset FILE sends the chat conversations of FILE (JSONL of {"messages": [...]}; see
# `benchmarks/speculative_bench.py --write-datasets`) greedy through /v1/chat/completions, each answer ending
# where the model ends it (up to --output-len tokens), instead of random prompts with ignore_eos.
#
# llama-server is built once from the llama.cpp sources that llama-cpp-python's source distribution
# vendors (taken from the package registry), and cached in $LADDER_PEER_CACHE (default
# ~/.cache/ladder/peer-llamacpp). Where a native build dies with SIGILL, set LLAMACPP_NATIVE=OFF: the
# build then names the ISA features /proc/cpuinfo lists (AVX2, AVX-512, VNNI, AMX) instead of -march=native.
# Where ggml's AMX matmul crashes (a KVM guest listing amx_tile: llama-server segfaults in
# ggml_backend_amx_mul_mat at its first step), add LLAMACPP_AMX=OFF to LLAMACPP_NATIVE=OFF.
# --isa avx2 builds both servers for an AVX2-only CPU's instructions (an AMD EPYC Zen 3's: AVX, AVX2, FMA,
# F16C, BMI2) on a machine that has more: llama.cpp with LLAMACPP_NATIVE=OFF and those GGML options alone,
# ladder's kernels with LADDER_CPU_CFLAGS="-mno-avx512f -mno-avxvnni". The caches and memory stay this
# machine's: a stand-in for such a host's code, not for the host.
# The results name the host (CPU model, cores, ISA flags) and the build (cmake options, llama.cpp's
# version) in $OUT/host.json, the table's header and peer_table.json.
# Never run in CI: it builds a C++ project and takes minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
LADDER=${LADDER:-$ROOT/.venv/bin/ladder}
CACHE=${LADDER_PEER_CACHE:-$HOME/.cache/ladder/peer-llamacpp}
VERSION=${LLAMACPP_PYTHON_VERSION:-0.3.36}
NATIVE=${LLAMACPP_NATIVE:-ON}
AMX=${LLAMACPP_AMX:-ON}
THREADS=${THREADS:-$(nproc)}
CONCURRENCY=1,4,16,32
PER_USER=4
INPUT_LEN=128
OUTPUT_LEN=128
OUT=benchmarks/results/peer_llamacpp
BUILD_ONLY=0
DATASET=
MODEL=
ISA=native
LADDER_ARGS=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --build-only) BUILD_ONLY=1; shift ;;
    --concurrency) CONCURRENCY=$2; shift 2 ;;
    --requests-per-user) PER_USER=$2; shift 2 ;;
    --input-len) INPUT_LEN=$2; shift 2 ;;
    --output-len) OUTPUT_LEN=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --dataset) DATASET=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --isa) ISA=$2; shift 2 ;;
    --) shift; LADDER_ARGS=("$@"); break ;;
    *) echo "peer_llamacpp.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

ISA_ONLY=  # the /proc/cpuinfo flags the build may use (all when empty)
case $ISA in
  native) ;;
  avx2) NATIVE=OFF; ISA_ONLY=" avx avx2 fma f16c bmi2 "
        export LADDER_CPU_CFLAGS="${LADDER_CPU_CFLAGS:+$LADDER_CPU_CFLAGS }-mno-avx512f -mno-avxvnni" ;;
  *) echo "peer_llamacpp.sh: --isa takes native or avx2, not $ISA" >&2; exit 2 ;;
esac
# The cmake options of the build: GGML_NATIVE, and without it one GGML_* option per ISA feature that
# /proc/cpuinfo lists (ggml's option names: avx512f is GGML_AVX512, which also turns on its BW/VL/DQ/CD parts).
CPU_FLAGS=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
CMAKE_FLAGS=(-DGGML_NATIVE="$NATIVE" -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF
             -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release)
if [[ $NATIVE == OFF ]]; then
  for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
              avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 amx_tile:AMX_TILE \
              amx_int8:AMX_INT8 amx_bf16:AMX_BF16; do
    [[ $AMX == OFF && $pair == amx* ]] && continue
    [[ -n $ISA_ONLY && $ISA_ONLY != *" ${pair%%:*} "* ]] && continue
    [[ $CPU_FLAGS == *" ${pair%%:*} "* ]] && CMAKE_FLAGS+=(-DGGML_"${pair#*:}"=ON)
  done
fi
# Keyed by this CPU's feature flags and the cmake options too: a native build from another machine may run
# here, tuned for that one, and the options recorded beside the results must be the binary's own.
CPU_KEY=$(printf '%s\n' $CPU_FLAGS "${CMAKE_FLAGS[@]}" | sort -u | sha256sum | cut -c1-12)
SERVER_BIN=$CACHE/$VERSION-native-$NATIVE-$CPU_KEY/llama-server
build_llama_server() {
  local work=$CACHE/build-$VERSION
  mkdir -p "$work"
  if [[ ! -f $work/src.tar.gz ]]; then
    "$PY" -m pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$work/dl"
    mv "$work"/dl/llama_cpp_python-*.tar.gz "$work/src.tar.gz"
  fi
  rm -rf "$work/src" "$work/build" && mkdir -p "$work/src"  # no objects built for another CPU
  tar -xzf "$work/src.tar.gz" -C "$work/src" --strip-components=1
  cmake -S "$work/src/vendor/llama.cpp" -B "$work/build" "${CMAKE_FLAGS[@]}" > "$work/cmake.log"
  cmake --build "$work/build" --target llama-server -j "$(nproc)" > "$work/build.log"
  mkdir -p "$(dirname "$SERVER_BIN")"
  # The GGML_* options cmake settled on (what NATIVE turned on is not in the command line), kept with the binary.
  grep -E '^GGML_[A-Z0-9_]+:BOOL=' "$work/build/CMakeCache.txt" > "$(dirname "$SERVER_BIN")/ggml-options.txt" || true
  cp "$work/build/bin/llama-server" "$SERVER_BIN"
}
if [[ ! -x $SERVER_BIN ]]; then
  echo "building llama-server from llama-cpp-python $VERSION's sources (GGML_NATIVE=$NATIVE; once)..."
  build_llama_server
fi
SERVER_VERSION=$("$SERVER_BIN" --version 2>&1 | head -2) \
  || { echo "llama-server does not start (SIGILL? rerun with LLAMACPP_NATIVE=OFF)"; exit 1; }
echo "$SERVER_VERSION"
[[ $BUILD_ONLY == 1 ]] && exit 0

GGUF=$("$PY" - "$MODEL" <<'EOF'
import sys
from pathlib import Path
from model.default import is_packaged, packaged_model_path
name = sys.argv[1] or None
print(packaged_model_path(name) if is_packaged(name) else Path(name).expanduser().resolve())
EOF
)
TOKENIZER_DIR=$(mktemp -d)
"$PY" - "$GGUF" "$TOKENIZER_DIR" <<'EOF'
import sys
from pathlib import Path
from model.gguf_checkpoint import GGUFCheckpoint
from model.tokenizer import Tokenizer
Tokenizer.from_gguf_metadata(GGUFCheckpoint(Path(sys.argv[1])).metadata, sys.argv[1]).save(Path(sys.argv[2]))
EOF
mkdir -p "$OUT"
# The host and the peer's build, for the table's header and peer_table.json: figures hold on one CPU.
"$PY" benchmarks/peer_table.py --record-host "$OUT" --threads "$THREADS" --llamacpp-python "$VERSION" \
  --server-version "$SERVER_VERSION" --ggml-options "$(dirname "$SERVER_BIN")/ggml-options.txt" \
  --ladder-cflags "${LADDER_CPU_CFLAGS:-}" -- "${CMAKE_FLAGS[@]}"
IFS=, read -r -a LEVELS <<< "$CONCURRENCY"
MAX_USERS=${LEVELS[-1]}
PORT_PEER=${PORT_PEER:-8091}
PORT_LADDER=${PORT_LADDER:-8092}

source benchmarks/server_wait.sh
require_free_port "$PORT_PEER" "$PORT_LADDER"

WORKLOAD=(--input-len "$INPUT_LEN")
if [[ -n $DATASET ]]; then
  WORKLOAD=(--dataset file --dataset-path "$DATASET" --endpoint chat --temperature 0 --no-ignore-eos)
fi
sweep() {  # name base_url
  for users in "${LEVELS[@]}"; do
    # --no-keep-alive: llama-server closes idle keep-alive connections, and a request written on one it
    # just closed fails as a connection error (about 1 in 5 at 32 users); both servers get the same.
    "$LADDER" loadtest --base-url "$2" --model default --tokenizer "$TOKENIZER_DIR" --no-keep-alive \
      "${WORKLOAD[@]}" --output-len "$OUTPUT_LEN" --max-concurrency "$users" \
      --num-requests $((users * PER_USER)) --warmup "$users" --seed 0 --quiet --out "$OUT/$1-c$users" \
      > "$OUT/$1-c$users.txt"
    echo "  $1 concurrency $users done"
  done
}

# One server at a time: both would share the same cores.
echo "llama-server: $GGUF, $THREADS threads, $MAX_USERS slots, continuous batching"
"$SERVER_BIN" -m "$GGUF" --host 127.0.0.1 --port "$PORT_PEER" -t "$THREADS" -tb "$THREADS" -np "$MAX_USERS" \
  -c $((MAX_USERS * (INPUT_LEN + OUTPUT_LEN + 64))) --cont-batching --alias default > "$OUT/llama-server.log" 2>&1 &
PEER=$!
trap 'kill $PEER 2> /dev/null || true' EXIT
wait_ready "http://127.0.0.1:$PORT_PEER/health" $PEER
sweep llamacpp "http://127.0.0.1:$PORT_PEER"
kill $PEER; wait $PEER 2> /dev/null || true

echo "ladder serve: $GGUF ${LADDER_ARGS[*]}"
"$LADDER" serve --model "$GGUF" --served-model-name default --port "$PORT_LADDER" "${LADDER_ARGS[@]}" \
  > "$OUT/ladder.log" 2>&1 &
LADDER_PID=$!
trap 'kill $LADDER_PID 2> /dev/null || true' EXIT
wait_ready "http://127.0.0.1:$PORT_LADDER/ready" $LADDER_PID
sweep ladder "http://127.0.0.1:$PORT_LADDER"
kill $LADDER_PID; wait $LADDER_PID 2> /dev/null || true

"$PY" benchmarks/peer_table.py "$OUT" "${LEVELS[@]}"
