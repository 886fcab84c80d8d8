"""The C++ CPU kernels: one torch extension built from kernels/csrc, and the one shape of every CPU op.

Build. `torch.utils.cpp_extension.load` compiles every kernels/csrc/*.cpp into one library on first use
(cached under torch's extensions directory; `python -m kernels.cpu_extension` builds it ahead, as `make
setup` does) and loads it into the process. The library has no Python module of its own: its sources
register their kernels for the ladder:: ops defined here in Python, and define the few ops that are not
kernels (build facts, the shared-memory all-reduce) in the ladder_cpu namespace, so no source includes
torch's Python headers. A failed build (no compiler, no ninja) is logged once and `load()` returns None,
so every op runs its torch reference.

The build uses `-march=native`, so a cached build may hold instructions another CPU lacks (SIGILL on
first use). torch keys its cache by source and flags only, so the extension's name carries a digest of
this CPU's instruction-set features: a shared or copied cache directory (a container image, a network
home) never hands one CPU's build to another. It carries a digest of the sources and of the torch
installation (version and path) too: torch keeps one build per name and rebuilds when the sources or its
own include paths differ, so two checkouts with different sources, or two virtual environments, would
otherwise rebuild over each other every time the other one ran.

Build lock. torch's builder takes a `lock` file in the build directory (created exclusively, removed when
the build ends) and waits without end while another process's is there; a build killed midway leaves it
behind, and every later start would hang on it. So each build (or load from the cache) runs under an
OS-level exclusive lock of our own, `build_lock`: a flock on BUILD_LOCK in the same directory, which the
kernel releases when its holder dies. While we hold it no other builder of this directory is alive, so
a torch `lock` found then is a leftover and is removed at once. Two processes starting together: one
builds, the other waits on the flock and then loads the cached build. The wait has a limit,
LADDER_KERNEL_BUILD_TIMEOUT seconds (default 900; a cold build takes about 35 s on two cores), past which
`KernelBuildTimeout` says, in one line, which lock file and what to do. The protocol's tag is in the
extension's name, so a build directory is only ever shared by builders that take the flock.

Units. The compiler reads torch's headers in about 8 s and most sources compile in 1-3 s after that, so
each source as its own object spent two thirds of the build on the same headers. The build compiles
translation units instead (`build_units`): the decode attention's source alone (its templated tasks,
one per group size, head size and dtype, are half the build's code) and every other source together,
each unit a file that includes copies of the sources kept in the build directory (so the directory
holds exactly what it was built from, and two checkouts of the same sources share it without
rebuilding). Two units build in about half the time on two cores (35 s against 70 s) and in about half
the CPU time. So the sources of one unit share one anonymous namespace: a helper's name must be unique
across them.

Switch. LADDER_CPU_KERNELS=0, read once when this module is imported, leaves the extension unloaded:
every op then runs its torch reference. LADDER_CPU_CFLAGS adds compiler flags (in the build's name too):
`-mno-avx512f` builds the AVX2 code paths on an AVX-512 machine, to test or time them there.

Ops. `cpu_op(name, reference, fake)` defines the custom op ladder::<name> from its plain-torch reference
(the op's schema is the reference's signature). The op's own body runs the reference, on every device;
on a CPU tensor it first loads the extension, whose source file registers its C++ kernel for the op's
CPU key, and re-dispatches to it. From then on the dispatcher calls the C++ kernel straight away (under
inference mode no Python runs on the way), and torch.compile sees one opaque op with its fake. Adding a
CPU kernel: one .cpp in kernels/csrc ending in TORCH_LIBRARY_IMPL(ladder, CPU, m), and one wrapper
module with its reference, its fake and one `cpu_op` line.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import os
import platform
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

try:
    import fcntl
except ImportError:  # not a POSIX system: torch's own lock only
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

ENABLED = os.environ.get("LADDER_CPU_KERNELS", "1") != "0"
EXTRA_CFLAGS = os.environ.get("LADDER_CPU_CFLAGS", "").split()
CSRC = Path(__file__).with_name("csrc")
UNITS_ALONE = ("decode_attention.cpp",)  # compiled as a unit of its own: see "Units" above

LOCK_PROTOCOL = "flock-1"  # in the build's name: see "Build lock" above
BUILD_LOCK = "ladder_build.flock"  # our flock, beside torch's `lock` in the build directory
TORCH_LOCK = "lock"  # torch.utils.cpp_extension's FileBaton
TIMEOUT_ENV = "LADDER_KERNEL_BUILD_TIMEOUT"
DEFAULT_BUILD_TIMEOUT_S = 900.0  # far past a cold build (about 35 s on two cores)
WAIT_NOTICE_S = 5.0  # say that we wait once the wait is this long


def _write_if_changed(path: Path, text: str) -> None:
    """Write `text` to `path` unless it holds that text already (its modification time then stays)."""
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def cpu_kernels_enabled() -> bool:
    """Whether the C++ kernels may be used (LADDER_CPU_KERNELS as it was when ladder was imported)."""
    return ENABLED


def flags_of(cpuinfo: str) -> frozenset[str] | None:
    """The feature flags of the first CPU in /proc/cpuinfo text ("flags" on x86, "Features" on Arm); None
    for text without them."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return None


def read_cpuinfo() -> str:
    """/proc/cpuinfo's text ("" where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (empty where /proc/cpuinfo has none)."""
    return flags_of(read_cpuinfo()) or frozenset()


def cpu_features(cpuinfo: str, machine: str) -> str:
    """What `-march=native` compiles for, as one string: the machine and the sorted feature flags of the
    first CPU in /proc/cpuinfo text."""
    flags = flags_of(cpuinfo)
    if flags is None:  # no /proc/cpuinfo flags (macOS, say): the processor name
        return f"{machine}: {platform.processor()}"
    return f"{machine}: {' '.join(sorted(flags))}"


def cpu_build_key() -> str:
    """A short digest of this CPU's features, for the build cache's name."""
    return hashlib.sha256(cpu_features(read_cpuinfo(), platform.machine()).encode()).hexdigest()[:12]


def build_name(name: str, source: str) -> str:
    """The module (and cache directory) name: `name`, this CPU's feature digest, and the digest of the
    source text, the torch installation it builds against and the build lock's protocol (a directory is
    shared only by builders that take `build_lock`)."""
    key = f"{LOCK_PROTOCOL}\n{torch.__version__}\n{torch.__file__}\n{' '.join(EXTRA_CFLAGS)}\n{source}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:8]
    return f"{name}_{cpu_build_key()}_{digest}"


class KernelBuildTimeout(TimeoutError):
    """Another live process held the extension's build lock past LADDER_KERNEL_BUILD_TIMEOUT; one line."""


def build_timeout() -> float:
    """Seconds to wait for another process's build: LADDER_KERNEL_BUILD_TIMEOUT, default 900."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_BUILD_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also NaN
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: expected a number of seconds >= 0")
    return value


def _holder(path: Path) -> str:
    """The pid the lock's holder wrote into it, as words for a message."""
    try:
        pid = path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        pid = ""
    return f"pid {pid}" if pid.isdigit() else "another process"


@contextmanager
def build_lock(directory: Path, timeout: float) -> Iterator[None]:
    """Hold the build directory's flock (BUILD_LOCK) for the block, waiting at most `timeout` seconds for
    another process to release it (KernelBuildTimeout past that). Once held, no other builder is alive,
    so torch's `lock` left by a killed build is removed. The flock goes with this process if it dies.
    The lock file itself is never removed (a waiter may hold it open: removing it would let a third
    process lock another file of the same name)."""
    if fcntl is None:
        yield
        return
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / BUILD_LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        start = time.monotonic()
        noticed = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
                if waited >= timeout:
                    raise KernelBuildTimeout(
                        f"waited {waited:.0f} s for the C++ CPU kernels' build lock {path}, held by "
                        f"{_holder(path)} (a build still running or hung): let it finish or stop it, or raise "
                        f"{TIMEOUT_ENV} (seconds), or set LADDER_CPU_KERNELS=0 to run the torch references"
                    ) from None
                if not noticed and waited >= WAIT_NOTICE_S:
                    noticed = True
                    log.warning("waiting for %s's build of the C++ CPU kernels (lock %s, up to %.0f s)",
                                _holder(path), path, timeout)
                time.sleep(min(0.1, max(timeout - waited, 0.0)))
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        leftover = directory / TORCH_LOCK
        if leftover.exists():
            log.warning("removing %s, left by a build of the C++ CPU kernels that did not finish", leftover)
            leftover.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # releases the flock


class CpuExtension:
    """The extension built from every .cpp of `directory` (its headers count in the build's name)."""

    def __init__(self, name: str = "ladder_cpu_kernels", directory: Path = CSRC) -> None:
        self.name, self.directory = name, directory
        self._lock = threading.Lock()
        self._module: Any = None
        self._failed = False

    def sources(self) -> list[Path]:
        return sorted(self.directory.glob("*.cpp"))

    def write_units(self, build_dir: Path) -> list[Path]:
        """Copy the sources and headers into build_dir/src and write the translation units that include
        them (see "Units" above); files are rewritten only when their text changed, so ninja, which goes
        by modification times, does not rebuild an unchanged build."""
        src = build_dir / "src"
        src.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.directory.glob("*.cpp")) + sorted(self.directory.glob("*.h")):
            _write_if_changed(src / path.name, path.read_text())
        names = [p.name for p in self.sources()]
        alone = [n for n in names if n in UNITS_ALONE]
        groups = [[n] for n in alone] + [[n for n in names if n not in alone]]
        units = []
        for i, group in enumerate(g for g in groups if g):
            unit = build_dir / f"unit_{i}.cpp"
            _write_if_changed(unit, "".join(f'#include "src/{n}"\n' for n in group))
            units.append(unit)
        return units

    def build_name(self) -> str:
        files = sorted(self.directory.glob("*.cpp")) + sorted(self.directory.glob("*.h"))
        return build_name(self.name, "".join(f"{p.name}\n{p.read_text()}\n" for p in files))

    def load(self) -> Any:
        """torch.ops.ladder_cpu once the library is loaded (every C++ kernel registered), or None when
        switched off or when it cannot be built here (the reason is logged once)."""
        if self._module is not None or self._failed or not ENABLED:  # called on every step: no lock once settled
            return self._module
        with self._lock:
            if self._module is None and not self._failed:
                timeout = build_timeout()
                try:
                    from torch.utils.cpp_extension import _get_build_directory, load

                    name = self.build_name()
                    build_dir = Path(_get_build_directory(name, verbose=False))
                    with build_lock(build_dir, timeout):
                        load(
                            name=name,
                            sources=[str(p) for p in self.write_units(build_dir)],
                            # -fopenmp: at::parallel_for is OpenMP in the headers; without it loops run on one thread.
                            extra_cflags=["-O3", "-march=native", "-fopenmp", *EXTRA_CFLAGS],
                            extra_ldflags=["-fopenmp"],
                            is_python_module=False,
                            verbose=False,
                        )
                    self._module = torch.ops.ladder_cpu
                except KernelBuildTimeout:
                    raise  # another builder holds the lock: say so (a later call waits again), not run slow refs
                except Exception as error:  # noqa: BLE001  (no compiler, no ninja, an unsupported platform)
                    self._failed = True
                    log.warning("the C++ CPU kernels are unavailable, using the torch references: %s",
                                " ".join(str(error).split())[:300])
        return self._module


EXTENSION = CpuExtension()


def load() -> Any:
    """torch.ops.ladder_cpu once the library is loaded (loading registers every C++ kernel), or None
    where it cannot be used."""
    return EXTENSION.load()


_has_kernel: dict[str, bool] = {}


def _kernel_loaded(qualname: str) -> bool:
    """Whether the extension is loaded and registered a CPU kernel for the op (else its body would call
    itself)."""
    if qualname not in _has_kernel:
        if load() is None:
            return False
        _has_kernel[qualname] = torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CPU")
    return _has_kernel[qualname]


def cpu_op(name: str, reference: Callable[..., Any], fake: Callable[..., Any],
           mutates_args: tuple[str, ...] = ()) -> torch._ops.OpOverload:
    """Define ladder::<name> with `reference`'s signature as its schema and `fake` as its fake; returns
    the op. Its body: the C++ kernel for a CPU first argument (loading the extension on first use), else
    `reference`."""
    qualname = f"ladder::{name}"

    def body(*args: Any, **kwargs: Any) -> Any:
        first = args[0]
        if first.device.type == "cpu" and ENABLED and _kernel_loaded(qualname):
            return getattr(torch.ops.ladder, name).default(*args, **kwargs)
        return reference(*args, **kwargs)

    body.__signature__ = inspect.signature(reference, eval_str=True)  # type: ignore[attr-defined]
    op = torch.library.custom_op(qualname, body, mutates_args=mutates_args)
    op.register_fake(fake)
    return getattr(torch.ops.ladder, name).default


def main() -> int:
    """`python -m kernels.cpu_extension`: build (or load from the cache) now and say how it went."""
    logging.basicConfig(level=logging.WARNING)
    start = time.perf_counter()
    built = load() is not None
    state = "ready" if built else ("switched off" if not ENABLED else "unavailable, the torch references will be used")
    print(f"C++ CPU kernels: {state} ({time.perf_counter() - start:.1f} s; built as {EXTENSION.build_name()} "
          f"from {len(EXTENSION.sources())} sources for this CPU's features)")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
