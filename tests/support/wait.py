"""Polling with a deadline: every wait in the tests is bounded."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.5, what: str = "condition") -> Any:
    """The first truthy value of ``predicate()``, polled every ``interval`` s; fails after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
