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

Switch. LADDER_CPU_KERNELS=0, read once when this module is imported, leaves the extension unloaded:
every op then runs its torch reference.

Ops. `cpu_op(name, reference, fake)` defines the custom op ladder::<name> from its plain-torch reference
(the op's schema is the reference's signature). The op's own body runs the reference, on every device;
on a CPU tensor it first loads the extension, whose source file registers its C++ kernel for the op's
CPU key, and re-dispatches to it. From then on the dispatcher calls the C++ kernel straight away (under
inference mode no Python runs on the way), and torch.compile sees one opaque op with its fake. Adding a
CPU kernel: one .cpp in kernels/csrc ending in TORCH_LIBRARY_IMPL(ladder, CPU, m), and one wrapper
module with its reference, its fake and one `cpu_op` line.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

ENABLED = os.environ.get("LADDER_CPU_KERNELS", "1") != "0"
CSRC = Path(__file__).with_name("csrc")


def cpu_kernels_enabled() -> bool:
    """Whether the C++ kernels may be used (LADDER_CPU_KERNELS as it was when ladder was imported)."""
    return ENABLED


def cpu_features(cpuinfo: str, machine: str) -> str:
    """What `-march=native` compiles for, as one string: the machine and the sorted feature flags of the
    first CPU in /proc/cpuinfo text ("flags" on x86, "Features" on Arm)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return f"{machine}: {' '.join(sorted(set(value.split())))}"
    return f"{machine}: {platform.processor()}"  # no /proc/cpuinfo flags (macOS, say): the processor name


def cpu_build_key() -> str:
    """A short digest of this CPU's features, for the build cache's name."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            cpuinfo = f.read()
    except OSError:
        cpuinfo = ""
    return hashlib.sha256(cpu_features(cpuinfo, platform.machine()).encode()).hexdigest()[:12]


def build_name(name: str, source: str) -> str:
    """The module (and cache directory) name: `name`, this CPU's feature digest, and the digest of the
    source text and the torch installation it builds against."""
    digest = hashlib.sha256(f"{torch.__version__}\n{torch.__file__}\n{source}".encode()).hexdigest()[:8]
    return f"{name}_{cpu_build_key()}_{digest}"


class CpuExtension:
    """The extension built from every .cpp of `directory` (its headers count in the build's name)."""

    def __init__(self, name: str = "ladder_cpu_kernels", directory: Path = CSRC) -> None:
        self.name, self.directory = name, directory
        self._lock = threading.Lock()
        self._module: Any = None
        self._failed = False

    def sources(self) -> list[Path]:
        return sorted(self.directory.glob("*.cpp"))

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
                try:
                    from torch.utils.cpp_extension import _get_build_directory, load

                    name = self.build_name()
                    remove_stale_lock(Path(_get_build_directory(name, verbose=False)) / "lock")
                    load(
                        name=name,
                        sources=[str(p) for p in self.sources()],
                        # -fopenmp: at::parallel_for is OpenMP in the headers; without it loops run on one thread.
                        extra_cflags=["-O3", "-march=native", "-fopenmp"],
                        extra_ldflags=["-fopenmp"],
                        is_python_module=False,
                        verbose=False,
                    )
                    self._module = torch.ops.ladder_cpu
                except Exception as error:  # no compiler, no ninja, an unsupported platform
                    self._failed = True
                    log.warning("the C++ CPU kernels are unavailable, using the torch references: %s",
                                " ".join(str(error).split())[:300])
        return self._module


EXTENSION = CpuExtension()
STALE_LOCK_S = 900  # far past a build's length on two busy cores


def remove_stale_lock(lock: Path) -> None:
    """torch's builder holds a lock file in the build directory while it compiles and waits, without end,
    for any other process's lock to go; a build killed midway leaves its lock behind. A lock older than any
    build takes is such a leftover: remove it, so this process builds instead of waiting forever."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        log.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
        lock.unlink(missing_ok=True)


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
