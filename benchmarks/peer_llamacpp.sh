#!/usr/bin/env bash
# ladder serve against llama.cpp's own server, one after the other in one run, on the same GGUF file
# (the one the default model ships), with the same closed-loop workload at each concurrency.
#
#   benchmarks/peer_llamacpp.sh [--build-only] [--concurrency 1,4,16,32] [--requests-per-user 4]
#                               [--input-len 128] [--output-len 128] [--out DIR] [-- ladder serve args]
#
# llama-server is built once from the llama.cpp sources that llama-cpp-python's source distribution
# vendors (taken from the package registry), and cached in $LADDER_PEER_CACHE (default
# ~/.cache/ladder/peer-llamacpp). Where a native build dies with SIGILL, set LLAMACPP_NATIVE=OFF: the
# build then names the AVX-512 features /proc/cpuinfo lists instead of -march=native.
# Never run in CI: it builds a C++ project and takes minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
LADDER=${LADDER:-$ROOT/.venv/bin/ladder}
CACHE=${LADDER_PEER_CACHE:-$HOME/.cache/ladder/peer-llamacpp}
VERSION=${LLAMACPP_PYTHON_VERSION:-0.3.36}
NATIVE=${LLAMACPP_NATIVE:-ON}
THREADS=${THREADS:-$(nproc)}
CONCURRENCY=1,4,16,32
PER_USER=4
INPUT_LEN=128
OUTPUT_LEN=128
OUT=benchmarks/results/peer_llamacpp
BUILD_ONLY=0
LADDER_ARGS=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --build-only) BUILD_ONLY=1; shift ;;
    --concurrency) CONCURRENCY=$2; shift 2 ;;
    --requests-per-user) PER_USER=$2; shift 2 ;;
    --input-len) INPUT_LEN=$2; shift 2 ;;
    --output-len) OUTPUT_LEN=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --) shift; LADDER_ARGS=("$@"); break ;;
    *) echo "peer_llamacpp.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

# Keyed by this CPU's feature flags too: a native build from another machine may run here, tuned for that one.
CPU_KEY=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | sort -u | sha256sum | cut -c1-12)
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
  local flags=(-DGGML_NATIVE="$NATIVE" -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF
               -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF -DCMAKE_BUILD_TYPE=Release)
  if [[ $NATIVE == OFF ]]; then
    local cpu; cpu=$(grep -m1 '^flags' /proc/cpuinfo)
    for feature in avx avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16; do
      local option=${feature^^}; option=${option/AVX512_/AVX512_}
      [[ $cpu == *" $feature "* || $cpu == *" $feature" ]] && flags+=(-DGGML_"$option"=ON)
    done
  fi
  cmake -S "$work/src/vendor/llama.cpp" -B "$work/build" "${flags[@]}" > "$work/cmake.log"
  cmake --build "$work/build" --target llama-server -j "$(nproc)" > "$work/build.log"
  mkdir -p "$(dirname "$SERVER_BIN")"
  cp "$work/build/bin/llama-server" "$SERVER_BIN"
}
if [[ ! -x $SERVER_BIN ]]; then
  echo "building llama-server from llama-cpp-python $VERSION's sources (GGML_NATIVE=$NATIVE; once)..."
  build_llama_server
fi
"$SERVER_BIN" --version 2>&1 | head -2 || { echo "llama-server does not start (SIGILL? rerun with LLAMACPP_NATIVE=OFF)"; exit 1; }
[[ $BUILD_ONLY == 1 ]] && exit 0

GGUF=$("$PY" -c 'from model.default import default_model_path; print(default_model_path())')
TOKENIZER_DIR=$(mktemp -d)
"$PY" - "$GGUF" "$TOKENIZER_DIR" <<'EOF'
import sys
from pathlib import Path
from model.gguf_checkpoint import GGUFCheckpoint
from model.tokenizer import Tokenizer
Tokenizer.from_gguf_metadata(GGUFCheckpoint(Path(sys.argv[1])).metadata, sys.argv[1]).save(Path(sys.argv[2]))
EOF
mkdir -p "$OUT"
IFS=, read -r -a LEVELS <<< "$CONCURRENCY"
MAX_USERS=${LEVELS[-1]}
PORT_PEER=${PORT_PEER:-8091}
PORT_LADDER=${PORT_LADDER:-8092}

source benchmarks/server_wait.sh
require_free_port "$PORT_PEER" "$PORT_LADDER"

sweep() {  # name base_url
  for users in "${LEVELS[@]}"; do
    "$LADDER" loadtest --base-url "$2" --model default --tokenizer "$TOKENIZER_DIR" \
      --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --max-concurrency "$users" \
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
