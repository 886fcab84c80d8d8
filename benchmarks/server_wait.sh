# Sourced by the benchmark scripts that start servers: refuse a port another server already holds (its
# answers would be measured instead), and wait for a started server to answer.

require_free_port() {  # port...
  local port
  for port in "$@"; do
    if (exec 3<> "/dev/tcp/127.0.0.1/$port") 2> /dev/null; then
      echo "port $port is already in use (another server or benchmark?); choose another with the PORT variables" >&2
      exit 1
    fi
  done
}

wait_ready() {  # url pid
  for _ in $(seq 1 600); do
    curl -sf "$1" > /dev/null 2>&1 && return 0
    kill -0 "$2" 2> /dev/null || { echo "server exited while starting" >&2; return 1; }
    sleep 0.5
  done
  echo "server not ready after 300 s" >&2; return 1
}
