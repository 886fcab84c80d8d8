"""Building a C++ CPU kernel on first use: one lazily built, cached torch extension per kernel module.

`torch.utils.cpp_extension.load_inline` compiles the source once per machine (the build is cached under
torch's extensions directory) and imports it. A failed build (no compiler, no ninja) is logged once and
reported as None, so callers fall back to their torch path. LADDER_CPU_KERNELS=0 switches every CPU
kernel off.

The build uses `-march=native`, so a cached build may hold instructions another CPU lacks (SIGILL on
first use). torch keys its cache by source and flags only, so the extension's name carries a digest of
this CPU's instruction-set features: a shared or copied cache directory (a container image, a network
home) never hands one CPU's build to another. It carries a digest of the source and of the torch
installation (version and path) too: torch keeps one build per name and rebuilds when the source or its
own include paths differ, so two checkouts with different sources, or two virtual environments, would
otherwise rebuild over each other every time the other one ran.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from typing import Any

log = logging.getLogger(__name__)


def cpu_kernels_enabled() -> bool:
    return os.environ.get("LADDER_CPU_KERNELS", "1") != "0"


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


class LazyExtension:
    def __init__(self, name: str, source: str, functions: list[str], what: str) -> None:
        self.name, self.source, self.functions, self.what = name, source, functions, what
        self._lock = threading.Lock()
        self._module: Any = None
        self._failed = False

    def load(self) -> Any:
        """The compiled module, or None when it cannot be built here (the reason is logged once)."""
        if self._module is not None or self._failed:  # called on every step: no lock once settled
            return self._module
        with self._lock:
            if self._module is None and not self._failed:
                try:
                    from torch.utils.cpp_extension import load_inline

                    self._module = load_inline(
                        name=self.build_name(),
                        cpp_sources=self.source,
                        functions=self.functions,
                        # -fopenmp: at::parallel_for is OpenMP in the headers; without it loops run on one thread.
                        extra_cflags=["-O3", "-march=native", "-fopenmp"],
                        extra_ldflags=["-fopenmp"],
                        verbose=False,
                    )
                except Exception as error:  # no compiler, no ninja, an unsupported platform
                    self._failed = True
                    log.warning("%s unavailable, using the torch path: %s", self.what,
                                " ".join(str(error).split())[:300])
        return self._module

    def build_name(self) -> str:
        """The module (and cache directory) name: the kernel's name, this CPU's feature digest and the
        digest of the source and the torch installation it builds against."""
        import torch

        source = hashlib.sha256(f"{torch.__version__}\n{torch.__file__}\n{self.source}".encode()).hexdigest()[:8]
        return f"{self.name}_{cpu_build_key()}_{source}"

    def build_and_report(self) -> int:
        """`python -m kernels.<module>`: build (or load from the cache) now and say how it went."""
        import time

        start = time.perf_counter()
        built = self.load() is not None
        print(f"{self.what}: {'ready' if built else 'unavailable, the torch path will be used'} "
              f"({time.perf_counter() - start:.1f} s; built as {self.build_name()} for this CPU's features)")
        return 0
