"""What the ``dlrt cluster`` tests share: the command run as a user runs it, and the
processes a setup started, found by the state directory their command lines name."""
from __future__ import annotations

import subprocess
import sys

import psutil


def dlrt(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    """``dlrt ARGS...`` in a process of its own (its output captured as text)."""
    return subprocess.run([sys.executable, "-m", "dlrt.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def ours(state: str) -> list[psutil.Process]:
    """Every process whose command line names ``state`` (what the setup started)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(state in arg for arg in p.info["cmdline"] or []):
                found.append(p)
        except psutil.Error:
            pass
    return found
