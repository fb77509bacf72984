"""Shared helpers for the services' resource limits: the default connection cap (half the
open-file limit) and positive numbers read from environment variables, falling back to the
default with a warning on a bad value (docs/configuration.md lists the limits)."""
from __future__ import annotations

import logging
import os
import resource
from typing import Callable, Mapping, TypeVar

log = logging.getLogger("dlrt.limits")

T = TypeVar("T", int, float)


def half_open_files(soft_nofile: int | None = None, low: int = 16, high: int = 4096) -> int:
    """Half of the open-file limit (``soft_nofile``, default this process's soft RLIMIT_NOFILE),
    between ``low`` and ``high``: 512 at the usual 1024. The other half is left to everything
    else the process opens."""
    if soft_nofile is None:
        soft_nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft_nofile == resource.RLIM_INFINITY:
            soft_nofile = 1 << 16
    return max(low, min(high, int(soft_nofile) // 2))


def env_positive(name: str, default: T, cast: Callable[[str], T] = float,
                 env: Mapping[str, str] | None = None) -> T:
    """``$name`` (from ``env``, default the process's environment) as a number above 0; unset
    gives ``default``, and so does a bad value, with a warning naming it."""
    text = (os.environ if env is None else env).get(name)
    if not text:
        return default
    try:
        value = cast(text)
    except ValueError:
        log.warning("$%s=%r is not a number: %s used", name, text, default)
        return default
    if not value > 0:
        log.warning("$%s=%r must be above 0: %s used", name, text, default)
        return default
    return value
