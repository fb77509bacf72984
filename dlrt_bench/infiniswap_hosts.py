"""Infiniswap on emulated hosts (``dlrt_bench.testbed``): the device on one host, daemons on others.

The building blocks the cross-host benchmarks (``infiniswap bench --emulate-hosts``,
``bench/infiniswap_fio.py --emulate-hosts``) and the cross-host test share:

* :class:`HostCluster` — on a testbed (given, up), one ``infiniswap daemon`` per host but the
  first, each bound to its host's bridge address for control and data (so that is the address
  it advertises in MR_INFO) and run with its host's ``DLRT_HOST_ID`` (so a device elsewhere
  uses TCP, never shared memory); host 0 is the device host.  It measures what crossed the
  shaped links (the testbed's byte counters) and runs commands on the device host
  (:meth:`HostCluster.status`: ``infiniswap status`` of daemons and devices there).
* :class:`DeviceProcess` — ``infiniswap device`` with a FUSE file and a loop device, as a
  process on the device host that enters only its network namespace, so the mount and the
  loop device are usable here (fio runs in this namespace).
* :class:`AttachedDaemons` — the cluster's daemons as seen from another process (the
  benchmark's device side, started on the device host): addresses, pids, usage files, from
  the JSON file :meth:`HostCluster.write_attach_file` writes.
"""
from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from dlrt.procs import stop_processes
from infiniswap.local import DaemonProcess, LocalDaemons

from .testbed import Testbed

__all__ = ["HostCluster", "DeviceProcess", "AttachedDaemon", "AttachedDaemons", "link_delta"]

_DEVICE_READY = re.compile(r"status (?P<status>\S+) .* pid (?P<pid>\d+) mount (?P<mount>\S+) "
                           r"disk (?P<disk>\S+) loop (?P<loop>\S+)")


def _python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def link_delta(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]
               ) -> dict[str, dict[str, int]]:
    """Bytes each host sent and received over its link between two :meth:`HostCluster.links`."""
    return {h: {k: after[h][k] - before[h][k] for k in after[h]} for h in after}


class HostCluster(LocalDaemons):
    """``len(testbed.hosts) - 1`` daemons, one per host but host 0 (the device host).

    ``daemon_options``: keywords of :class:`infiniswap.local.DaemonProcess` (slab size,
    capacity, headroom, period, timeout, lock, ...).  ``start()`` returns once every daemon
    announced its addresses; ``stop()`` stops them (the testbed's ``down()`` would too)."""

    def __init__(self, testbed: Testbed, **daemon_options: Any) -> None:
        if len(testbed.hosts) < 2:
            raise ValueError("a cluster needs a device host and at least one daemon host")
        self.testbed = testbed
        self.device_host = testbed.hosts[0]
        self.daemon_hosts = testbed.hosts[1:]
        self.daemons = [
            DaemonProcess(bind=f"tcp://{h.addr}:0", popen=h.popen,
                          extra=["--data-host", h.addr, "--report-host", h.name],
                          **daemon_options)
            for h in self.daemon_hosts]

    def links(self) -> dict[str, dict[str, int]]:
        """Bytes each host has sent and received over its shaped link so far."""
        return {h.name: self.testbed.counters(h)._asdict() for h in self.testbed.hosts}

    def daemon_cpu_seconds(self) -> list[float]:
        return [d.cpu_seconds() for d in self.daemons]

    def status(self, devices: Sequence[str] = (), timeout: float = 30.0) -> dict[str, Any]:
        """``infiniswap status --json`` of every daemon (and ``devices``), asked from the
        device host (this namespace has no route to the testbed)."""
        cmd = _python_module("infiniswap.cli", "status", "--daemons", ",".join(self.addresses),
                             "--json", "-")
        if devices:
            cmd += ["--devices", ",".join(devices)]
        done = self.device_host.run(cmd, capture_output=True, timeout=timeout)
        if done.returncode not in (0, 1):       # 1: some did not answer (a killed daemon)
            raise RuntimeError(f"infiniswap status failed ({done.returncode}): "
                               f"{done.stderr.decode(errors='replace')[-2000:]}")
        return json.loads(done.stdout)

    def served_bytes(self, status: dict[str, Any]) -> int:
        """Bytes the daemons' data servers sent and received, from a :meth:`status`."""
        total = 0
        for report in status["daemons"].values():
            served = report.get("served") or {}
            total += served.get("bytes_read", 0) + served.get("bytes_written", 0)
        return total

    def write_attach_file(self, path: str) -> str:
        """The daemons, for a process on the device host (:meth:`AttachedDaemons.load`)."""
        with open(path, "w", encoding="utf-8") as fh:
            json.dump([asdict(AttachedDaemon(d.address, d.pid, d.usage_file or "", d.capacity,
                                             h.name))
                       for d, h in zip(self.daemons, self.daemon_hosts)], fh)
        return path


@dataclass
class AttachedDaemon:
    """A daemon another process started: what the benchmark's device side uses of it."""
    address: str
    pid: int
    usage_file: str
    capacity: int
    host: str

    # the same operations as a daemon this process started (they use only these fields)
    cpu_seconds = DaemonProcess.cpu_seconds
    set_usage = DaemonProcess.set_usage


class AttachedDaemons:
    """The daemons listed in an attach file; never stopped from here (their owner does)."""

    def __init__(self, daemons: Sequence[AttachedDaemon]) -> None:
        self.daemons = list(daemons)

    @classmethod
    def load(cls, path: str) -> "AttachedDaemons":
        with open(path, encoding="utf-8") as fh:
            return cls([AttachedDaemon(**d) for d in json.load(fh)])

    @property
    def addresses(self) -> list[str]:
        return [d.address for d in self.daemons]

    def stop(self) -> list[int | None]:
        return [None for _ in self.daemons]


class DeviceProcess:
    """``infiniswap device`` on ``cluster``'s device host serving ``size`` bytes as a FUSE file
    and a loop device (direct I/O), with every slab mapped at start (``map_all``).  The
    backup file and the mount point are under ``workdir`` (a disk file system); ``stop()``
    SIGTERMs it (it unmounts and detaches), and cleans up with ``infiniswap device stop``
    if it cannot."""

    def __init__(self, cluster: HostCluster, size: int, slab_size: int, workdir: str, *,
                 map_all: bool = True, hot_slab: float = 20.0, period: float = 0.2,
                 timeout: float = 1.0) -> None:
        self.cluster = cluster
        self.mount = os.path.join(workdir, "mnt")
        self.backup = os.path.join(workdir, "backup")
        self.log_path = os.path.join(workdir, "device.log")
        self.cmd = _python_module(
            "infiniswap.cli", "device", "--size", str(size), "--slab-size", str(slab_size),
            "--backup", self.backup, "--daemons", ",".join(cluster.addresses),
            "--mount", self.mount, "--loop", "--no-harden", "--hot-slab", str(hot_slab),
            "--period", str(period), "--timeout", str(timeout), "--status-bind", "127.0.0.1:0",
            *(["--map-all"] if map_all else []))
        self.proc: subprocess.Popen | None = None
        self.loop_device = ""
        self.status_address = ""
        self.pid = 0

    def start(self, wait: float = 60.0) -> "DeviceProcess":
        with open(self.log_path, "wb") as log:
            self.proc = self.cluster.device_host.popen(
                self.cmd, mount_visible=True, stdout=subprocess.PIPE, stderr=log,
                stdin=subprocess.DEVNULL)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], wait)
        line = self.proc.stdout.readline().decode(errors="replace") if ready else ""
        m = _DEVICE_READY.search(line)
        if m is None:
            self.stop()
            raise RuntimeError(f"the device did not start within {wait:g} s ({line!r}); its log "
                               f"ends with:\n{self.log_tail()}")
        self.loop_device, self.status_address = m["loop"], m["status"]
        self.pid = int(m["pid"])
        return self

    def log_tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                return "".join(fh.readlines()[-n:])
        except OSError:
            return ""

    def stats(self) -> dict[str, Any]:
        """The device's own report (``infiniswap status --devices``), asked on its host."""
        return self.cluster.status([self.status_address])["devices"][self.status_address]

    def stop(self, wait: float = 30.0) -> None:
        if self.proc is not None:
            stop_processes([self.proc], wait)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self.proc = None
        if os.path.isdir(self.mount) and os.path.ismount(self.mount):
            stop = _python_module("infiniswap.cli", "device", "stop", "--mount", self.mount)
            subprocess.run(stop, capture_output=True, timeout=60)

    def __enter__(self) -> "DeviceProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- fio on the device's loop device ----

FIO_VERIFY = ["--direct=1", "--ioengine=libaio", "--verify=crc32c", "--verify_fatal=1",
              "--verify_state_save=0", "--output-format=json"]


def loop_ios(loop_device: str) -> int:
    """Reads plus writes the loop device has completed (its block-layer counters)."""
    with open(f"/sys/block/{os.path.basename(loop_device)}/stat", encoding="ascii") as fh:
        fields = fh.read().split()
    return int(fields[0]) + int(fields[4])


def fio_verify(loop_device: str, size: int, args: Sequence[str], timeout: float = 300.0,
               stall: float = 30.0) -> dict[str, Any]:
    """fio with crc32c verification on ``loop_device`` under a watchdog (no I/O completed for
    ``stall`` s: killed).  Returns rc, the job's error, bytes read and written, and why the
    watchdog or the timeout ended it ("" if neither)."""
    from dlrt_bench.infiniswap_stack import run_watched

    cmd = ["fio", "--name=verify", f"--filename={loop_device}", f"--size={size}",
           *FIO_VERIFY, *args]
    rc, out, err, fired = run_watched(cmd, lambda: loop_ios(loop_device), stall, timeout)
    result: dict[str, Any] = {"rc": rc, "stopped": fired, "error": None, "read_bytes": 0,
                              "write_bytes": 0, "stderr": err.strip()[-2000:]}
    if "{" in out:
        job = json.loads(out[out.index("{"):])["jobs"][0]
        result.update(error=job["error"], read_bytes=job["read"]["io_bytes"],
                      write_bytes=job["write"]["io_bytes"])
    result["ok"] = rc == 0 and not fired and result["error"] == 0
    return result


def verify_with_a_daemon_killed(cluster: HostCluster, device: DeviceProcess, size: int, *,
                                victim: int = 0, kill_after_ios: int = 20000,
                                bs: str = "4k") -> dict[str, Any]:
    """The integrity check across hosts: fio random read/write with crc32c verification on
    the device while daemon ``victim`` is SIGKILLed (once the loop device completed
    ``kill_after_ios`` I/Os), then a full write with verification and a verify-only pass.
    ``ok`` when every pass had zero errors and the last one read back the whole device."""
    victim_daemon = cluster.daemons[victim]
    killed = threading.Event()

    def kill_when_busy() -> None:
        base = loop_ios(device.loop_device)
        while not killed.is_set():
            if loop_ios(device.loop_device) - base >= kill_after_ios:
                victim_daemon.kill()                  # SIGKILL, reaped
                killed.set()
                return
            killed.wait(0.01)

    links0 = cluster.links()
    killer = threading.Thread(target=kill_when_busy, daemon=True)
    killer.start()
    passes = {"randrw_while_killed": fio_verify(device.loop_device, size,
                                                [f"--bs={bs}", "--iodepth=16", "--rw=randrw",
                                                 "--loops=1"])}
    was_killed = killed.is_set()
    killed.set()
    killer.join()
    passes["write_and_verify"] = fio_verify(device.loop_device, size,
                                            ["--bs=64k", "--iodepth=16", "--rw=write",
                                             "--do_verify=1"])
    passes["verify_only"] = fio_verify(device.loop_device, size,
                                       ["--bs=64k", "--iodepth=16", "--rw=write",
                                        "--verify_only=1"])
    stats = device.stats()
    return {"ok": was_killed and all(p["ok"] for p in passes.values())
            and passes["verify_only"]["read_bytes"] == size,
            "killed": victim_daemon.address if was_killed else None, "passes": passes,
            "device": {"daemon_failures": stats["daemon_failures"], "io": stats["io"],
                       "transports": sorted({d["transport"] for d in stats["daemons"].values()
                                             if d["transport"]})},
            "link_bytes": link_delta(links0, cluster.links())}
