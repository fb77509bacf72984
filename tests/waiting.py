"""Polling until something holds, for tests that watch real processes: ``from waiting import wait_for``."""
from __future__ import annotations

import time
from typing import Any, Callable


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition", step: float = 0.1) -> Any:
    """``predicate()``'s first true value, polled every ``step`` s; AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def until(what: str, predicate: Callable[[], Any], timeout: float = 30.0) -> Any:
    """``wait_for`` with the description first, polling every 50 ms."""
    return wait_for(predicate, timeout, what, step=0.05)
