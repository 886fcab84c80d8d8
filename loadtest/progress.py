"""A one-line live progress bar on stderr, redrawn on a timer rather than per request."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TextIO

BAR_WIDTH = 24
REDRAW_SECONDS = 0.25


class Progress:
    def __init__(self, label: str, total: int | None, duration: float | None, enabled: bool,
                 stream: TextIO = sys.stderr) -> None:
        self.label = label
        self.total = total  # requests, when known; otherwise progress is measured against `duration`
        self.duration = duration
        self.enabled = enabled
        self.stream = stream
        self.num_ok = 0
        self.num_failed = 0
        self.in_flight = 0
        self._start = time.perf_counter()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._start = time.perf_counter()
        if self.enabled:
            self._task = asyncio.get_running_loop().create_task(self._redraw_forever())

    def sent(self) -> None:
        self.in_flight += 1

    def done(self, ok: bool) -> None:
        self.in_flight -= 1
        if ok:
            self.num_ok += 1
        else:
            self.num_failed += 1

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
            self._draw()
            self.stream.write("\n")
            self.stream.flush()

    async def _redraw_forever(self) -> None:
        while True:
            self._draw()
            await asyncio.sleep(REDRAW_SECONDS)

    def _draw(self) -> None:
        elapsed = time.perf_counter() - self._start
        num_done = self.num_ok + self.num_failed
        if self.total:
            fraction, count = num_done / self.total, f"{num_done}/{self.total}"
        else:
            fraction, count = elapsed / self.duration, f"{num_done}"
        filled = round(BAR_WIDTH * min(1.0, fraction))
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        failed = f" failed {self.num_failed}" if self.num_failed else ""
        self.stream.write(f"\r{self.label} [{bar}] {count} | in flight {self.in_flight}{failed} | {elapsed:.1f} s ")
        self.stream.flush()
