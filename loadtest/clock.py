"""Where the load test reads the time: the real clock in a run; the tests put a virtual one in its place,
so that the arrival schedule, send lag, durations and token timestamps they check do not depend on how
fast or busy the machine is."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    """Seconds on a monotonic scale with an arbitrary origin: only differences between readings mean
    anything."""

    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """`time.perf_counter()`, the finest monotonic clock, for timestamps; the event loop's timers for
    waits. A timer may wake a little late; the open loop records that as send lag."""

    def now(self) -> float:
        return time.perf_counter()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
