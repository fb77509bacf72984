"""Keep a process on the paging path from deadlocking under memory pressure.

A process that serves the swap device (the ``infiniswap device`` process with its FUSE
threads) or serves remote memory to it (an ``infiniswap daemon``: its TCP data server
thread) must never need the swap device itself: a page of it swapped out into the device
can only come back through it (DESIGN.md §4: the tmpfs swap-loop deadlock).
:func:`harden_process` does what a process can do for itself:

* ``mlockall`` — nothing of the process is ever swapped out.  First ``MCL_CURRENT``
  (everything mapped now is faulted in and locked), then ``MCL_FUTURE | MCL_ONFAULT``:
  later mappings are locked page by page as they are touched.  Not plain ``MCL_FUTURE``,
  which would fault in every new mapping whole: a daemon's slab memfd (its whole lending
  capacity, sparse on purpose), the same memfd mapped by a device on the same host, and
  8 MiB per thread stack.  For the same reason the ``MCL_CURRENT`` step is skipped (with
  a log line) when a memfd is already mapped: call this first thing, before slab memory
  is mapped and before threads start.
* ``prctl(PR_SET_IO_FLUSHER, 1)`` — the kernel treats the process as part of the I/O
  path: its allocations do not recurse into I/O (``PF_MEMALLOC_NOIO``) and it is
  throttled only on its own dirty pages (``PF_LOCAL_THROTTLE``).  Needs
  ``CAP_SYS_RESOURCE``; per thread, inherited by threads created later — hence "first
  thing" again.
* ``oom_score_adj = -1000`` — the OOM killer never picks it (it would take the swap
  device down with it).

Each step that fails is logged as a warning saying what it costs and what to do; the
caller decides whether to go on.  What to do depends on why a capability is missing:
:func:`capability_hint` tells a non-root process to run as root, and a root process that
lacks the capability (a container, or a launcher that dropped it) where it went missing.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
from dataclasses import dataclass, field

__all__ = ["HardeningReport", "harden_process", "capability_hint"]

log = logging.getLogger("infiniswap.hardening")

MCL_CURRENT = 1
MCL_FUTURE = 2
MCL_ONFAULT = 4
PR_SET_IO_FLUSHER = 57
PR_GET_IO_FLUSHER = 58
CAP_IPC_LOCK = 14
CAP_SYS_RESOURCE = 24


@dataclass
class HardeningReport:
    """Which protections are in force (and why the others are not)."""

    mlocked: bool = False
    io_flusher: bool = False
    oom_protected: bool = False
    failures: dict[str, str] = field(default_factory=dict)   # step -> reason

    @property
    def complete(self) -> bool:
        return self.mlocked and self.io_flusher and self.oom_protected

    def summary(self) -> str:
        parts = [f"{name} {'on' if on else 'OFF'}" for name, on in
                 (("mlockall", self.mlocked), ("io_flusher", self.io_flusher),
                  ("oom_score_adj=-1000", self.oom_protected))]
        return ", ".join(parts)


def _capability_sets() -> tuple[int | None, int | None]:
    """This process's (effective, bounding) capability masks from /proc/self/status."""
    found: dict[str, int] = {}
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key in ("CapEff", "CapBnd"):
                    found[key] = int(value.strip(), 16)
    except (OSError, ValueError):
        pass
    return found.get("CapEff"), found.get("CapBnd")


def capability_hint(name: str, bit: int, *, euid: int | None = None, effective: int | None = None,
                    bounding: int | None = None) -> str:
    """What to tell the user when an operation needing capability ``name`` (number ``bit``)
    was refused.  ``euid``, ``effective`` and ``bounding`` (capability masks) default to
    this process's own; a mask that cannot be read counts as lacking the capability."""
    if euid is None:
        euid = os.geteuid()
    if effective is None and bounding is None:
        effective, bounding = _capability_sets()
    if effective is not None and effective >> bit & 1:
        return (f"needs {name}, which this process has: a security policy refused it "
                "(seccomp, AppArmor, SELinux)")
    if euid != 0:
        return f"needs {name} (run as root)"
    short = name.removeprefix("CAP_")
    if bounding is not None and not bounding >> bit & 1:
        return (f"needs {name}, which is missing from the capability bounding set of this root "
                f"process (e.g. a container started without it: add it, e.g. --cap-add {short})")
    return (f"needs {name}, which is missing from the effective capability set of this root "
            "process (dropped by whatever started it, e.g. capsh or setpriv: keep it)")


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _memfd_mapped() -> bool:
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            return any("/memfd:" in line for line in fh)
    except OSError:
        return False


def _mlockall(libc: ctypes.CDLL, report: HardeningReport) -> None:
    libc.mlockall.argtypes = [ctypes.c_int]
    if _memfd_mapped():
        log.info("a memfd is mapped already: locking only what is resident now (a full "
                 "MCL_CURRENT would fault in the whole memfd)")
        first = MCL_CURRENT | MCL_ONFAULT
    else:
        first = MCL_CURRENT
    for flags in (first, MCL_FUTURE | MCL_ONFAULT):
        if libc.mlockall(flags) != 0:
            err = ctypes.get_errno()
            hint = ("raise RLIMIT_MEMLOCK (ulimit -l), or: "
                    + capability_hint("CAP_IPC_LOCK", CAP_IPC_LOCK)
                    if err in (errno.ENOMEM, errno.EPERM, errno.EAGAIN) else
                    "the kernel lacks MCL_ONFAULT (Linux >= 4.4 needed)" if err == errno.EINVAL
                    else "")
            report.failures["mlockall"] = f"mlockall({flags:#x}): {os.strerror(err)}" + (
                f"; {hint}" if hint else "")
            if flags != first:
                libc.munlockall()   # do not leave a half-done state behind
            return
    report.mlocked = True


def _io_flusher(libc: ctypes.CDLL, report: HardeningReport) -> None:
    prctl = libc.prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                      ctypes.c_ulong]
    if prctl(PR_SET_IO_FLUSHER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        hint = (capability_hint("CAP_SYS_RESOURCE", CAP_SYS_RESOURCE) if err == errno.EPERM else
                "needs Linux >= 5.6" if err == errno.EINVAL else "")
        report.failures["io_flusher"] = f"prctl(PR_SET_IO_FLUSHER): {os.strerror(err)}" + (
            f"; {hint}" if hint else "")
        return
    report.io_flusher = prctl(PR_GET_IO_FLUSHER, 0, 0, 0, 0) == 1


def _oom(report: HardeningReport) -> None:
    try:
        with open("/proc/self/oom_score_adj", "w", encoding="ascii") as fh:
            fh.write("-1000")
        with open("/proc/self/oom_score_adj", encoding="ascii") as fh:
            report.oom_protected = fh.read().strip() == "-1000"
    except OSError as exc:
        hint = "; " + capability_hint("CAP_SYS_RESOURCE", CAP_SYS_RESOURCE) if exc.errno in (
            errno.EACCES, errno.EPERM) else ""
        report.failures["oom_score_adj"] = f"/proc/self/oom_score_adj: {exc.strerror}{hint}"


def harden_process(what: str = "this process", *, mlock: bool = True, io_flusher: bool = True,
                   oom: bool = True) -> HardeningReport:
    """Apply the protections (see the module doc) to the calling process; returns which
    are in force.  Call it first thing, from the main thread.  Failures are logged as
    warnings naming ``what`` and are not raised."""
    report = HardeningReport()
    libc = _libc()
    if mlock:
        _mlockall(libc, report)
    if io_flusher:
        _io_flusher(libc, report)
    if oom:
        _oom(report)
    for step, reason in report.failures.items():
        log.warning("%s: %s failed: %s — %s may deadlock or be killed under memory "
                    "pressure while a swap device pages into Infiniswap", what, step, reason,
                    what)
    log.info("%s hardened: %s", what, report.summary())
    return report
