"""Infiniswap: remote-memory paging over a block device (thesis chapter 2).

A ``Device`` is a fixed-size block device split into slabs; a slab that gets hot is mapped
into the memory of a ``Daemon`` chosen by power of two choices, so its pages are read and
written there (shared memory on the same host, TCP across hosts) while a backup file keeps
a copy of everything.  Daemons lend the memory their machine does not need, keep HeadRoom
free for local applications by batch-evicting the least active slabs, and there is no
central coordinator: a device only knows a list of daemons.  Every page written reads back
the same through evictions and daemon failures.  A ``Frontend`` serves a device as a FUSE
file, attachable as a loop device and usable as swap.  ``infiniswap --help`` lists the
commands.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Device", "Daemon", "Frontend"]

# imported on first use, so that the pure modules (placement, eviction, protocol, ...) can be
# imported without the built C core and without a cycle through the package
_LAZY = {"Device": "infiniswap.device", "Daemon": "infiniswap.daemon", "Frontend": "infiniswap.frontend"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'infiniswap' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
