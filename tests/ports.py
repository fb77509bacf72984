"""Free TCP ports on loopback for the servers a test starts."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (the kernel's pick; a race with other binders is possible)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
