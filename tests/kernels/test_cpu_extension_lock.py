"""The C++ extension's build lock (kernels/cpu_extension.py, "Build lock"): a flock of our own around
torch's build, so a torch `lock` file left by a killed build never hangs the next start, a live builder is
waited for up to LADDER_KERNEL_BUILD_TIMEOUT with a one-line error past it, and two processes starting at
once both end up with the one build. Every test uses its own directory: the real build cache is untouched."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kernels import cpu_extension
from kernels.cpu_extension import BUILD_LOCK, TIMEOUT_ENV, TORCH_LOCK, KernelBuildTimeout, build_lock, build_timeout

ROOT = Path(__file__).resolve().parents[2]

# Holds the flock the way a builder does (pid written in it) until killed: a build in progress.
HOLDER = r"""
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.write(fd, str(os.getpid()).encode())
print("held", flush=True)
time.sleep(300)
"""

# One process starting: builds (or loads from the cache) a tiny extension in TORCH_EXTENSIONS_DIR.
LOADER = r"""
import sys
from pathlib import Path
from kernels.cpu_extension import CpuExtension
assert CpuExtension("ladder_lock_probe", Path(sys.argv[1])).load() is not None
print("loaded", flush=True)
"""


def test_a_leftover_torch_lock_is_removed_once_the_build_lock_is_held(tmp_path):
    leftover = tmp_path / TORCH_LOCK
    leftover.touch()  # just now: an age test would keep it (a build killed a minute ago)
    start = time.monotonic()
    with build_lock(tmp_path, timeout=5):
        assert not leftover.exists()
        assert (tmp_path / BUILD_LOCK).read_text() == str(os.getpid())
    assert time.monotonic() - start < 2
    with build_lock(tmp_path, timeout=0):  # released on leaving the block: taken again at once
        pass
    assert (tmp_path / BUILD_LOCK).exists()  # never removed (a waiter may hold it open)


@pytest.mark.skipif(cpu_extension.fcntl is None, reason="flock is POSIX")
def test_a_live_builder_is_waited_for_then_times_out_with_one_line(tmp_path):
    (tmp_path / TORCH_LOCK).touch()  # the live builder's own torch lock
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / BUILD_LOCK)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        with pytest.raises(KernelBuildTimeout) as raised, build_lock(tmp_path, timeout=0.5):
            pytest.fail("took the lock a live process holds")
        assert 0.5 <= time.monotonic() - start < 3
        message = str(raised.value)
        assert "\n" not in message and str(tmp_path / BUILD_LOCK) in message and f"pid {holder.pid}" in message
        assert TIMEOUT_ENV in message and "LADDER_CPU_KERNELS=0" in message
        assert (tmp_path / TORCH_LOCK).exists()  # a live builder's lock is left alone
    finally:
        holder.kill()  # a build killed midway: its torch lock stays, its flock goes with it
        holder.wait()
    start = time.monotonic()
    with build_lock(tmp_path, timeout=5):
        assert not (tmp_path / TORCH_LOCK).exists()
    assert time.monotonic() - start < 2


def test_build_timeout_reads_its_variable(monkeypatch):
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert build_timeout() == cpu_extension.DEFAULT_BUILD_TIMEOUT_S
    monkeypatch.setenv(TIMEOUT_ENV, "2.5")
    assert build_timeout() == 2.5
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv(TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=TIMEOUT_ENV):
            build_timeout()


@pytest.mark.skipif(cpu_extension.fcntl is None, reason="flock is POSIX")
def test_two_starts_past_a_leftover_lock_share_one_build(tmp_path):
    """The real load path (torch's builder in its build directory) on a one-function extension: a fresh
    leftover torch lock, and two processes starting at once; both load, neither hangs."""
    from torch.utils.cpp_extension import _get_build_directory, is_ninja_available

    if not is_ninja_available():
        pytest.skip("no ninja: the extension cannot build here")
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "probe.cpp").write_text("int ladder_lock_probe() { return 1; }\n")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"), "LADDER_CPU_KERNELS": "1",
           "MAX_JOBS": "1", TIMEOUT_ENV: "240"}
    old = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = env["TORCH_EXTENSIONS_DIR"]
    try:
        name = cpu_extension.CpuExtension("ladder_lock_probe", csrc).build_name()
        build_dir = Path(_get_build_directory(name, verbose=False))
    finally:
        if old is None:
            del os.environ["TORCH_EXTENSIONS_DIR"]
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = old
    (build_dir / TORCH_LOCK).touch()  # left a moment ago by a killed build
    starts = [subprocess.Popen([sys.executable, "-c", LOADER, str(csrc)], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        results = [start.communicate(timeout=240) for start in starts]
    finally:
        for start in starts:
            start.kill()
            start.wait()
    for start, (out, err) in zip(starts, results):
        assert start.returncode == 0 and "loaded" in out, err[-3000:]
    assert not (build_dir / TORCH_LOCK).exists()
    assert len(list(build_dir.glob("*.so"))) == 1  # built once, loaded by both
