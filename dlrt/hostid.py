"""This machine's identity, so peers can tell whether they share a machine.

Two processes may use ipc sockets or shared memory between them only when their host ids
are equal. The id is ``hostname/boot-id``: equal only for processes on the same running
kernel (containers on one host share the boot id but usually differ in hostname -- then
they simply use TCP). ``DLRT_HOST_ID`` in the environment overrides it, for hosts that
share a kernel but not a network (emulated hosts in network namespaces).
"""
from __future__ import annotations

import functools
import os
import socket

__all__ = ["host_id", "HOST_ID_ENV"]

HOST_ID_ENV = "DLRT_HOST_ID"


@functools.lru_cache(maxsize=1)
def _machine_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = ""
    host = socket.gethostname()
    return f"{host}/{boot}" if boot else host


def host_id() -> str:
    """``$DLRT_HOST_ID`` when set, else ``hostname/boot-id``."""
    return os.environ.get(HOST_ID_ENV) or _machine_id()
