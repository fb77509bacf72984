"""Helpers shared by the Infiniswap integration tests (polling with a deadline)."""
from __future__ import annotations

import time


def wait_until(cond, timeout: float, what: str, step: float = 0.02) -> None:
    """Poll ``cond()`` every ``step`` seconds; fail the test naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
