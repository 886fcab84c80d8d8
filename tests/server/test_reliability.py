"""Bad input under load and engine faults: each refused before it costs work (never tokenized when too
long, the allowed long text tokenized off the event loop) while a concurrent stream goes on, a failed step
and a hung step answered, a full disk leaving no half-written artifact. Tiny model.

No assertion here reads a clock: the times of the floods table (`pytest -s`) are printed, not checked."""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from compile.manifest import write_artifact
from compile.pipeline import save_weights
from engine.backends.manifest import Manifest
from engine.async_engine import ENGINE_HUNG
from server_process import free_port
from in_process_server import InProcessServer, make_state

STEP_PACE = 0.02  # seconds each forward is held, so the watched stream lasts the whole flood
MAX_MODEL_LEN = 256


class StreamWatch:
    """A streaming completion read on its own thread, every chunk's arrival time kept."""

    def __init__(self, url: str, max_tokens: int = 240) -> None:
        self.times: list[float] = []
        self.events: list[str] = []
        self.first = threading.Event()
        self.arrived = threading.Condition()
        body = {"prompt": "hi", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self.thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self.thread.start()
        assert self.first.wait(30), "the watched stream never started"

    def _read(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        with self.arrived:
                            self.times.append(time.perf_counter())
                            self.events.append(line)
                            self.arrived.notify_all()
                        self.first.set()
        finally:
            with self.arrived:
                self.arrived.notify_all()

    def next_chunk(self, timeout: float = 30.0) -> bool:
        """Waits for the stream's next chunk; False if the stream ended (or stalled past `timeout`) first."""
        with self.arrived:
            seen = len(self.events)
            return self.arrived.wait_for(lambda: len(self.events) > seen or not self.thread.is_alive(), timeout) \
                and len(self.events) > seen

    def stall(self, start: float, end: float) -> float:
        """The longest gap between chunks that overlaps [start, end] (the gap running at `end` included)."""
        times = self.times + [time.perf_counter()]
        gaps = [b - a for a, b in zip(times, times[1:]) if b >= start and a <= end]
        return max(gaps, default=0.0)

    def median_gap(self) -> float:
        gaps = sorted(b - a for a, b in zip(self.times, self.times[1:]))
        return gaps[len(gaps) // 2]


class TokenizerWatch:
    """Every text the server's tokenizer encodes: its length, and whether the event loop's thread ran it."""

    def __init__(self, tokenizer, loop_thread: threading.Thread) -> None:
        self.calls: list[tuple[int, bool]] = []
        self.tokenizer = tokenizer
        real = tokenizer.encode

        def encode(text, *args, **kwargs):
            self.calls.append((len(text), threading.current_thread() is loop_thread))
            return real(text, *args, **kwargs)

        tokenizer.encode = encode

    def close(self) -> None:
        del self.tokenizer.encode  # the class's method again


@pytest.fixture(scope="module")
def paced_server(tiny_dir):
    server = InProcessServer(make_state(tiny_dir, max_model_len=MAX_MODEL_LEN, max_queue=24,
                                        max_prompts_per_request=8))
    real = server.state.engine.engine.runner.forward

    def paced(inputs):
        time.sleep(STEP_PACE)
        return real(inputs)

    server.state.engine.engine.runner.forward = paced
    yield server
    server.stop()


# (name, path, body, status, error code or None): every hole of the issue, as an attacker would send it.
FLOODS = [
    ("10,000 prompts in one request", "/v1/completions", {"prompt": ["a"] * 10_000, "max_tokens": 1}, 400,
     "too_many_prompts"),
    ("8 prompts x n=16 (128 sequences > max-queue 24)", "/v1/completions",
     {"prompt": ["a"] * 8, "n": 16, "max_tokens": 1}, 400, "too_many_sequences"),
    ("6 prompts x n=4 with the queue partly held", "/v1/completions",
     {"prompt": ["a"] * 6, "n": 4, "max_tokens": 1}, 429, None),
    ("1,000,000 token ids", "/v1/completions", {"prompt": [1] * 1_000_000, "max_tokens": 1}, 400,
     "context_length_exceeded"),
    ("3.8 MB prompt text", "/v1/completions", {"prompt": "ab " * 1_250_000, "max_tokens": 1}, 400,
     "prompt_too_long"),
    ("16 stop strings of 100,000 characters", "/v1/completions",
     {"prompt": "hi", "max_tokens": 1, "stop": ["x" * 100_000] * 16}, 400, None),
    ("100,000 chat messages", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "a"}] * 100_000, "max_tokens": 1}, 400, None),
    ("one 3.8 MB chat message", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "ab " * 1_250_000}], "max_tokens": 1}, 400, "prompt_too_long"),
]


def test_floods_get_4xx_before_any_work_while_a_stream_goes_on(paced_server):
    server = paced_server
    limit = server.state.settings.prompt_char_limit(MAX_MODEL_LEN)
    tokenized = TokenizerWatch(server.state.engine.info.tokenizer, server.thread)
    rows = []
    try:
        with httpx.Client(timeout=60) as client:
            watch = StreamWatch(server.url)
            for name, path, body, status, code in FLOODS:
                content = json.dumps(body).encode()  # encoded before the clock starts: the server's time is measured
                # A fresh chunk first, so that a stall in the table is charged to the request that caused it.
                assert watch.next_chunk(), f"the watched stream ended before {name}"
                start = time.perf_counter()
                response = client.post(server.url + path, content=content,
                                       headers={"content-type": "application/json"})
                end = time.perf_counter()
                assert response.status_code == status, (name, response.text[:300])
                if code is not None:
                    assert response.json()["error"]["code"] == code, name
                rows.append((name, len(content), status, end - start, watch.stall(start, end)))
                assert watch.next_chunk(), f"the watched stream stopped after {name}"
            # Every flood was refused before its text reached the tokenizer: only short texts were tokenized.
            assert all(chars <= limit for chars, _ in tokenized.calls), tokenized.calls
            # The same size of text, allowed this time: it is tokenized (on a worker thread) and only then
            # refused for its token count, while the stream goes on.
            server.state.settings.max_prompt_chars = 4_000_000
            try:
                text = "hello world, this is a test. " * 12_000
                assert watch.next_chunk(), "the watched stream ended before the long text"
                start = time.perf_counter()
                response = client.post(server.url + "/v1/completions", json={"prompt": text, "max_tokens": 1})
                end = time.perf_counter()
            finally:
                server.state.settings.max_prompt_chars = None
            assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
            assert [on_loop for chars, on_loop in tokenized.calls if chars == len(text)] == [False]
            rows.append(("0.35 MB text tokenized off the event loop", len(text), 400, end - start,
                         watch.stall(start, end)))
            assert watch.next_chunk(), "the watched stream stopped after the long text"
            watch.thread.join(60)
    finally:
        tokenized.close()
    assert watch.events[-1] == "data: [DONE]" and not any('"error"' in event for event in watch.events)
    print(f"\nwatched stream: median gap {watch.median_gap() * 1000:.0f} ms")
    print(f"{'request':<52} {'bytes':>9} {'status':>6} {'answered':>9} {'stream stall':>12}")
    for name, size, status, answered, stall in rows:
        print(f"{name:<52} {size:>9} {status:>6} {answered * 1000:>6.0f} ms {stall * 1000:>9.0f} ms")
    engine = server.state.engine
    assert server.state.admission.num_sequences == 0
    assert engine.engine.blocks.num_free_blocks == engine.engine.blocks.num_blocks


def test_step_that_raises_once_fails_its_requests_and_the_engine_serves_on(tiny_dir):
    server = InProcessServer(make_state(tiny_dir))
    try:
        engine = server.state.engine
        real = engine.engine.runner.forward
        calls = {"n": 0}

        def fails_once(inputs):
            calls["n"] += 1
            if calls["n"] == 5:
                raise RuntimeError("injected fault")
            time.sleep(0.005)
            return real(inputs)

        engine.engine.runner.forward = fails_once
        with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                          json={"prompt": "hi", "max_tokens": 50, "ignore_eos": True, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["type"] == "server_error"
        after = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
        assert after.status_code == 200 and after.json()["choices"][0]["finish_reason"] in ("stop", "length")
        assert httpx.get(server.url + "/health").status_code == 200
        assert engine.num_step_failures == 1 and engine.is_alive
        assert engine.engine.blocks.num_free_blocks == engine.engine.blocks.num_blocks
    finally:
        server.stop()


def test_hung_step_becomes_503_with_a_log_line(tiny_dir, caplog):
    state = make_state(tiny_dir, step_timeout=0.5)
    server = InProcessServer(state)
    release = threading.Event()
    try:
        real = state.engine.engine.runner.forward
        calls = {"n": 0}

        hung_returned = threading.Event()

        def hangs(inputs):
            calls["n"] += 1
            if calls["n"] == 3:
                release.wait(30)  # a forward that never returns, until the test lets it go
                hung_returned.set()
            return real(inputs)

        state.engine.engine.runner.forward = hangs
        caplog.set_level(logging.ERROR, logger="engine.async_engine")
        with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                          json={"prompt": "hi", "max_tokens": 50, "ignore_eos": True, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        error = json.loads(events[-2][6:])["error"]
        assert error["type"] == "service_unavailable" and error["message"] == ENGINE_HUNG
        assert not hung_returned.is_set()  # answered by the watchdog while the step still hangs
        plain = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
        assert plain.status_code == 503
        assert httpx.get(server.url + "/health").status_code == 503
        assert any("over the 0.5 s step timeout" in record.getMessage() for record in caplog.records)
    finally:
        release.set()
        server.stop()


def test_disk_full_while_writing_an_artifact_leaves_nothing(tiny_dir, tmp_path):
    """A real ENOSPC from a 256 KiB tmpfs where root may mount one; elsewhere a real EFBIG from a file-size
    limit. Either way the writer fails with the OS error and leaves no directory, whole or half."""
    import model

    module = model.load(str(tiny_dir)).module  # its weights are megabytes: they cannot fit
    manifest = Manifest(backend="torch-compile", precision="fp32", model={"name": "tiny"}, shapes={},
                        device={}, libraries={})
    root = tmp_path / "small"
    root.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(root)],
                                                   capture_output=True).returncode == 0
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = None
    try:
        if not mounted:
            handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
            resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, limit[1]))
        # safetensors wraps the OS error in its own exception type; the message carries the OS's words.
        with pytest.raises(Exception, match="No space left on device" if mounted else "File too large"):
            write_artifact(root / "artifact", manifest, lambda tmp: save_weights(module, tmp))
    finally:
        if not mounted:
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)
            signal.signal(signal.SIGXFSZ, handler)
        left = sorted(p.name for p in root.iterdir())
        if mounted:
            subprocess.run(["umount", str(root)], check=True)
    assert left == []  # neither the artifact nor its temporary directory
    assert not Path(root / "artifact").exists()


def test_short_soak_loses_nothing(tiny_dir, tmp_path):
    """benchmarks/soak.py for 9 s (its default is 30 minutes; the SIGKILL phase runs there, not here):
    0 unexpected errors, 0 KV blocks held, every accepted request answered, a PNG and JSON written."""
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "soak.py"), "--minutes", "0.15",
                          "--capacity-seconds", "2", "--model", str(tiny_dir), "--out", str(tmp_path),
                          "--no-kill", "--port", str(free_port())], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "soak.json").read_text())
    assert result["unexpected"] == 0 and result["kv_blocks_held_at_end"] == 0
    assert result["kinds"].get("bad", 0) > 0 and result["kinds"].get("disconnect", 0) > 0
    assert (tmp_path / "soak.png").stat().st_size > 0


def test_cpu_kernel_cache_is_keyed_by_the_cpu_features_and_the_source():
    """A -march=native build cached on one CPU is never loaded on a CPU with other features."""
    from kernels.cpu_extension import build_name, cpu_build_key, cpu_features

    avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2\nprocessor\t: 1\nflags\t\t: fpu sse2 avx avx2\n"
    avx512 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512bw\n"
    assert cpu_features(avx2, "x86_64") != cpu_features(avx512, "x86_64")
    assert cpu_features(avx2, "x86_64") == cpu_features("flags : avx2 avx fpu sse2\n", "x86_64")  # order-free
    assert cpu_features("Features\t: fp asimd sve\n", "aarch64") == "aarch64: asimd fp sve"
    name = build_name("ladder_probe", "")
    assert name.startswith(f"ladder_probe_{cpu_build_key()}_") and name.isidentifier()
    assert build_name("ladder_probe", "int f();") != name  # another source
