"""Server programs in child processes on loopback ports: `ladder serve` itself, or the fake OpenAI server
of loadtest's tests (fake_openai_server.py). One runner starts them, waits until they answer, and stops
them. Standard library only, so that the fake server still runs by hand without the project installed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

API_KEY = "test-key-123"

# Loopback only: a proxy from the environment must never sit between a test and its server.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 10.0, api_key: str | None = None) -> tuple[int, bytes]:
    """(status, body) of a GET, with `api_key` as a bearer token if given; an HTTP error status is
    returned, not raised."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


class ServerProcess:
    """`argv` in a child process that serves HTTP on `port`: ready once GET `ready_path` answers 200.

    Its output goes to `log` (a temporary file when None, removed by `stop`); a start that fails (the
    process exits, or is not ready within `timeout` seconds) raises with the log's tail."""

    def __init__(self, argv: list[str], *, port: int, ready_path: str, log: Path | None = None,
                 timeout: float = 120.0, env: dict[str, str] | None = None) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._own_log = log is None
        if log is None:
            fd, name = tempfile.mkstemp(prefix="server-", suffix=".log")
            os.close(fd)
            log = Path(name)
        self.log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready(ready_path, timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, ready_path: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if http_get(self.url + ready_path, timeout=1)[0] == 200:
                    return
            except OSError:  # not listening yet
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {timeout} s: {self.log_tail()}")

    def log_tail(self, num_chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-num_chars:] if self.log.exists() else ""

    def terminate(self) -> None:
        """SIGTERM: the server's own graceful shutdown."""
        self.proc.send_signal(signal.SIGTERM)

    def stop(self, grace: float = 0.0) -> None:
        """Ends the process: SIGTERM and up to `grace` seconds to exit, then SIGKILL."""
        if self.proc.poll() is None and grace > 0:
            self.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        if self._own_log:
            self.log.unlink(missing_ok=True)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LadderServer(ServerProcess):
    """`ladder serve <args>` on a free port, ready when /ready answers."""

    def __init__(self, *args: str, log: Path | None = None, timeout: float = 120.0) -> None:
        port = free_port()
        # With a key the server protects /metrics by default: `metrics` sends it.
        self.api_key = args[args.index("--api-key") + 1] if "--api-key" in args else None
        env = {k: v for k, v in os.environ.items() if k != "LADDER_API_KEY"}
        super().__init__([sys.executable, "-m", "ladder.cli", "serve", "--port", str(port), *args], port=port,
                         ready_path="/ready", log=log, timeout=timeout, env=env)

    def metrics(self) -> dict[str, float]:
        """The Prometheus samples of /metrics by their full name (labels included)."""
        status, body = http_get(self.url + "/metrics", timeout=5, api_key=self.api_key)
        assert status == 200, status
        values = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values
