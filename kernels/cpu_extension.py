"""Building a C++ CPU kernel on first use: one lazily built, cached torch extension per kernel module.

`torch.utils.cpp_extension.load_inline` compiles the source once per machine (the build is cached under
torch's extensions directory) and imports it. A failed build (no compiler, no ninja) is logged once and
reported as None, so callers fall back to their torch path. LADDER_CPU_KERNELS=0 switches every CPU
kernel off.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

log = logging.getLogger(__name__)


def cpu_kernels_enabled() -> bool:
    return os.environ.get("LADDER_CPU_KERNELS", "1") != "0"


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
                        name=self.name,
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

    def build_and_report(self) -> int:
        """`python -m kernels.<module>`: build (or load from the cache) now and say how it went."""
        import time

        start = time.perf_counter()
        built = self.load() is not None
        print(f"{self.what}: {'ready' if built else 'unavailable, the torch path will be used'} "
              f"({time.perf_counter() - start:.1f} s)")
        return 0
