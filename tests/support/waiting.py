"""Waiting for a condition instead of sleeping and hoping it holds: poll it until a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float = 30.0, interval: float = 0.02, what: str = "") -> T:
    """Calls `condition` until it returns a true value, and returns that value; fails the test when
    `timeout` seconds pass first. The deadline is for a stuck test, not a measurement."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s: {what or getattr(condition, '__name__', condition)}")
        time.sleep(interval)
    return value
