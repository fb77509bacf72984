"""The ``infiniswap`` command: run a daemon or a device, ask for status, simulate, benchmark.

    infiniswap daemon   [--bind 127.0.0.1:7300] [--headroom 8G] [--slab-size 1G] ...
                        [--reports ADDR] [--metrics-port PORT] [--report-host NAME]
    infiniswap device   --size 4G --backup FILE --daemons ADDR,ADDR,... [--status-bind ADDR]
                        [--mount DIR [--loop] [--swap] [--swap-priority N]]
    infiniswap device stop --mount DIR
    infiniswap status   --daemons ADDR,... [--devices ADDR,...] [--json FILE]
    infiniswap run      --memory 64M [--swappiness N] -- CMD...
    infiniswap simulate --machines 1000 [--json FILE]
    infiniswap bench    --size 2G --num-daemons 3 [--json FILE]

This module owns argument parsing, signal handling (SIGTERM/SIGINT end a daemon or device
cleanly, exit status 0) and the status table; the convention (addresses as ``HOST:PORT`` or
``tcp://HOST:PORT``, ``--json FILE`` with ``-`` for stdout, ``--log-level`` on every command,
help with defaults) is ``dlrt.cli``'s. A bad argument or an error the user can fix is one
line on stderr and exit status 2 (usage) or 1 (runtime), never a traceback. ``simulate`` and
``bench`` parse their own options (``bench`` imports ``dlrt_bench`` only when it runs).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Sequence

from dlrt import cli
from dlrt.cli import UsageError
from dlrt.procs import die_with_parent
from dlrt.sizes import format_size, parse_size

__all__ = ["main"]

log = logging.getLogger("infiniswap.cli")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# commands that parse their own options: name -> (module, help)
FORWARDED = {
    "simulate": ("infiniswap.simulate", "cluster-scale placement and eviction simulation"),
    "bench": ("dlrt_bench.infiniswap_bench", "benchmark remote memory (shm, TCP) against the backup file"),
}




def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad number {text!r}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be positive")
        return v
    return parse


class _Signals:
    """SIGTERM/SIGINT handlers installed for the life of a command (before it announces
    itself, so a signal sent right after the announcement is never lost)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.name = ""
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "_Signals":
        for s in (signal.SIGTERM, signal.SIGINT):
            self._old[s] = signal.signal(s, self._handler)
        return self

    def _handler(self, signum: int, _frame: Any) -> None:
        self.name = signal.Signals(signum).name
        self._event.set()

    def wait(self) -> str:
        while not self._event.wait(0.5):
            pass
        return self.name

    def __exit__(self, *exc: object) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


# ---- daemon ----

def _file_reader(path: str) -> Callable[[], int]:
    def read() -> int:
        with open(path, encoding="utf-8") as fh:
            return parse_size(fh.read().strip() or "0")
    return read


def _harden(what: str) -> None:
    from infiniswap.hardening import harden_process
    harden_process(what)


def _metrics_host(bind: str) -> str:
    """Where the Prometheus exporter listens: the host of ``--bind`` (127.0.0.1 unless it
    says otherwise; any address for ``*``, 127.0.0.1 for ipc://)."""
    from dlrt.endpoints import endpoint

    ep = endpoint(bind, bind=True)
    if not ep.startswith("tcp://"):
        return "127.0.0.1"
    host = ep[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return "0.0.0.0" if host == "*" else host


def _open_reporters(args: argparse.Namespace, stack: contextlib.ExitStack) -> list[Any]:
    """The ``--reports`` publisher and ``--metrics-port`` exporter asked for, closed by ``stack``."""
    from infiniswap.report import PrometheusExporter, ReportPublisher

    reporters: list[Any] = []
    if args.reports:
        reporters.append(stack.enter_context(contextlib.closing(ReportPublisher(args.reports))))
    if args.metrics_port:
        exporter = PrometheusExporter(args.metrics_port, _metrics_host(args.bind))
        reporters.append(stack.enter_context(contextlib.closing(exporter)))
    return reporters


def _announce_reporters(reporters: Sequence[Any]) -> str:
    """`` reports ENDPOINT`` / `` metrics URL`` for the ready line (after ``pid N``)."""
    from infiniswap.report import ReportPublisher

    return "".join(f" reports {r.address}" if isinstance(r, ReportPublisher)
                   else f" metrics {r.url}" for r in reporters)


def _cmd_daemon(args: argparse.Namespace) -> int:
    if args.transport == "rdma":
        from infiniswap.rdma import check_transport
        check_transport(args.transport)         # fails at once without an RDMA device
    if args.exit_with_parent:
        if not die_with_parent(signal.SIGTERM):
            log.warning("--exit-with-parent: the kernel refused PR_SET_PDEATHSIG")
    # First thing, before slab memory is mapped and threads start: the data server thread
    # is on the paging path of devices that swap into this daemon.
    if not args.no_harden and os.geteuid() == 0:
        _harden("infiniswap daemon")
    if args.no_lock:
        log.warning("--no-lock: slab memory is not mlocked by the daemon; do not use it on a "
                    "host where an Infiniswap device is used as swap (slab pages swapped out "
                    "into that device can deadlock it)")
    from infiniswap.daemon import Daemon

    control_limits, data_limits = _daemon_limits(args)
    reader = total = None
    if args.emulate_usage:
        if args.capacity is None:
            raise UsageError("--emulate-usage needs --capacity (the emulated machine's memory)")
        reader, total = _file_reader(args.emulate_usage), args.capacity
    if not 0 <= args.metrics_port <= 65535:
        raise UsageError(f"--metrics-port {args.metrics_port} must be in 0..65535 (0 = off)")
    with contextlib.ExitStack() as stack, _Signals() as signals:
        reporters = _open_reporters(args, stack)
        rdma = None
        if args.transport == "rdma":
            from infiniswap.rdma import RdmaDevice
            rdma = stack.enter_context(RdmaDevice())        # closed after daemon.stop()
        daemon = Daemon(args.bind, headroom=args.headroom, slab_size=args.slab_size,
                        capacity=args.capacity, total_memory=total, memory_reader=reader,
                        period=args.period, timeout=args.timeout, lock=not args.no_lock,
                        data_host=None if args.no_data_server else args.data_host,
                        data_port=args.data_port, host_name=args.report_host,
                        reporters=reporters, report_interval=args.report_interval, rdma=rdma,
                        control_limits=control_limits, data_limits=data_limits)
        daemon.start()
        try:
            print(f"infiniswap daemon: control {daemon.address} data "
                  f"{daemon.data_address or 'none'} pid {os.getpid()}"
                  f"{_announce_reporters(reporters)}", flush=True)
            log.info("%s: shutting down", signals.wait())
        finally:
            daemon.stop()
    return 0


def _daemon_limits(args: argparse.Namespace) -> tuple[Any, Any]:
    """The daemon's ``ControlLimits`` and ``DataLimits``: the environment's (or the
    defaults), overridden by the options given."""
    import dataclasses

    from infiniswap.limits import ControlLimits, DataLimits

    ctl = ControlLimits.from_env()
    given = {name: value for name, value in (
        ("max_peers", args.control_max_peers), ("peer_ttl", args.control_peer_ttl),
        ("rate", args.control_rate), ("max_message", args.control_max_message))
        if value is not None}
    if args.control_rate is not None:
        given["burst"] = max(1.0, 3 * args.control_rate)
    data = DataLimits.from_env()
    data_given = {name: value for name, value in (
        ("max_connections", args.data_max_connections),
        ("handshake_timeout", args.data_handshake_timeout)) if value is not None}
    try:
        return dataclasses.replace(ctl, **given), dataclasses.replace(data, **data_given)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


# ---- device ----

def _cmd_device(args: argparse.Namespace) -> int:
    if (args.loop or args.swap or args.swap_priority is not None) and not args.mount:
        raise UsageError("--loop, --swap and --swap-priority need --mount DIR")
    if args.swap_priority is not None and not -1 <= args.swap_priority <= 32767:
        raise UsageError(f"--swap-priority {args.swap_priority} must be in -1..32767")
    if args.transport == "rdma":
        from infiniswap.rdma import check_transport
        check_transport(args.transport)         # fails at once, before the backup file is made
    from infiniswap.backupspace import backup_shortfall
    short = backup_shortfall(args.backup, args.size)
    if short and args.swap:                     # pages the kernel swaps out past it would be lost
        raise UsageError(f"{short}: as swap, pages written past it would be lost; use a smaller "
                         "--size or a --backup on a disk with room")
    if short:
        log.warning("%s: a disk write past it fails and that page is lost", short)
    if args.mount and not args.no_harden:
        # First thing, before threads start and before a daemon's memfd is mapped: this
        # process serves the pages the kernel swaps out.
        _harden("infiniswap device")
    from infiniswap.device import Device

    with _Signals() as signals:
        dev = Device(args.size, backup=args.backup, daemons=args.daemons,
                     slab_size=args.slab_size, hot_slab=args.hot_slab, period=args.period,
                     timeout=args.timeout, transport=args.transport,
                     status_bind=args.status_bind, device_id=args.device_id)
        fe = None
        try:
            if args.map_all:
                n = dev.map_now()
                log.info("mapped %d of %d slabs", n, dev.num_slabs)
            extra = ""
            if args.mount:
                from infiniswap.frontend import Frontend
                fe = Frontend(dev, args.mount, loop=args.loop or args.swap, swap=args.swap,
                              swap_priority=args.swap_priority,
                              fsname=f"infiniswap-{os.getpid()}").start()
                extra = (f" mount {fe.mountpoint} disk {fe.disk_path} loop "
                         f"{fe.loop_device or 'none'} swap {'on' if fe.swap_on else 'off'}")
            print(f"infiniswap device: {dev.device_id} status {dev.status_address or 'none'} "
                  f"size {args.size} slabs {dev.num_slabs} pid {os.getpid()}{extra}", flush=True)
            log.info("%s: shutting down", signals.wait())
        finally:
            try:
                if fe is not None:
                    _stop_frontend(fe)
            finally:
                dev.close()
    return 0


def _stop_frontend(fe: Any) -> None:
    """Undo the front end in reverse order.  While swapoff fails the swap area is still in
    use (pages of other processes are in it): keep serving and retry rather than exit."""
    from infiniswap.frontend import SwapStillActive

    delay = 1.0
    while True:
        try:
            fe.stop()
            return
        except SwapStillActive as exc:
            log.error("%s; still serving %s, retrying in %g s (SIGKILL abandons it: processes "
                      "with pages in this swap would then crash)", exc, fe.disk_path, delay)
            time.sleep(delay)
            delay = min(delay * 2, 10.0)


def _cmd_device_stop(args: argparse.Namespace) -> int:
    """Stop the device serving --mount: SIGTERM it and wait for its own cleanup; if it is
    gone (crashed, SIGKILLed), undo what it left: swapoff, losetup -d, unmount."""
    from infiniswap import frontend

    mount = os.path.abspath(args.mount)
    state = frontend.read_state(mount)
    pid = int((state or {}).get("pid") or 0)
    if frontend.owner_alive(state):
        log.info("stopping infiniswap device pid %d (SIGTERM)", pid)
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + args.timeout
        while frontend.owner_alive(state):
            if time.monotonic() > deadline:
                print(f"infiniswap device stop: error: device pid {pid} is still cleaning up "
                      f"{mount} after {args.timeout:g} s (swapoff may need longer): run this "
                      f"again, or kill -9 {pid} and run it again", file=sys.stderr)
                return 1
            time.sleep(0.1)
    elif state is None and not frontend.remains(mount):
        print(f"infiniswap device stop: nothing to stop at {mount}")
        return 0
    done = frontend.cleanup(mount)
    for step in done:
        log.info("cleanup: %s", step)
    left = frontend.remains(mount)
    if left:
        print(f"infiniswap device stop: error: still up: {', '.join(left)}", file=sys.stderr)
        return 1
    print(f"infiniswap device stop: {mount}: stopped"
          + (f" (cleaned up after a dead device: {', '.join(done)})" if done else ""))
    return 0


# ---- status ----

def _ask_status(addr: str, timeout: float) -> dict[str, Any]:
    from infiniswap import protocol as p
    from infiniswap.channel import ask

    try:
        msg = ask(addr, p.STATUS, timeout=timeout)
    except (TimeoutError, p.ProtocolError, ValueError) as exc:
        return {"error": str(exc)}
    if msg.op != p.REPORT:
        return {"error": f"{addr} answered {msg.op}: {msg.get('reason', '')}"}
    return msg["report"]


def _fmt_bytes(n: Any) -> str:
    return format_size(n) if isinstance(n, (int, float)) else "-"


def _format_status(result: dict[str, Any]) -> str:
    lines: list[str] = []
    if result["daemons"]:
        lines.append("daemons")
        lines.append(f"  {'address':<28} {'free':>10} {'can lend':>10} {'slabs':>6} {'mapped':>7} "
                     f"{'evicted':>8} {'served':>10}  devices")
        for addr, r in result["daemons"].items():
            if "error" in r:
                lines.append(f"  {addr:<28} unreachable: {r['error']}")
                continue
            served = r.get("served") or {}
            served_bytes = served.get("bytes_read", 0) + served.get("bytes_written", 0)
            devices = ", ".join(f"{k}:{len(v)}" for k, v in r["devices"].items()) or "-"
            lines.append(f"  {addr:<28} {_fmt_bytes(r['free_bytes']):>10} "
                         f"{_fmt_bytes(r['giveable_bytes']):>10} {r['slabs_free']:>6} "
                         f"{r['slabs_mapped']:>7} {r['evictions']:>8} "
                         f"{_fmt_bytes(served_bytes):>10}  {devices}")
    if result["devices"]:
        lines.append("devices")
        for addr, r in result["devices"].items():
            if "error" in r:
                lines.append(f"  {addr}: unreachable: {r['error']}")
                continue
            io = r["io"]
            lines.append(f"  {r['device_id']} ({addr}): {format_size(r['size'])}, "
                         f"{r['slabs_mapped']}/{r['num_slabs']} slabs mapped, "
                         f"remote r/w {format_size(io['bytes_read_remote'])}/"
                         f"{format_size(io['bytes_written_remote'])}, disk r/w "
                         f"{format_size(io['bytes_read_disk'])}/"
                         f"{format_size(io['bytes_written_disk_sync'] + io['bytes_written_disk_async'])}, "
                         f"maps {r['maps']}, evictions {r['evictions']}, "
                         f"daemon failures {r['daemon_failures']}")
            for s in r["slabs"]:
                if s["daemon"] is not None or s["activity"] > 0:
                    lines.append(f"    slab {s['slab']:>5}  {s['state']:<9} "
                                 f"{s['daemon'] or 'backup file':<28} A={s['activity']:.1f}/s")
    return "\n".join(lines) if lines else "nothing to show"


def _cmd_status(args: argparse.Namespace) -> int:
    if not args.daemons and not args.devices:
        raise UsageError("give --daemons and/or --devices to ask")
    result = {"daemons": {a: _ask_status(a, args.timeout) for a in args.daemons or []},
              "devices": {a: _ask_status(a, args.timeout) for a in args.devices or []}}
    cli.emit(args.json, result, _format_status(result))
    failed = [a for kind in result.values() for a, r in kind.items() if "error" in r]
    if failed:
        print(f"infiniswap status: no answer from {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


# ---- run ----

def _vmstat_swap() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/vmstat", encoding="ascii") as fh:
            for line in fh:
                key, _, value = line.partition(" ")
                if key in ("pswpin", "pswpout"):
                    out[key] = int(value)
    except (OSError, ValueError):
        pass
    return out


def _cmd_run(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UsageError("give the command to run after --, e.g. infiniswap run --memory 64M "
                         "-- python app.py")
    if args.swappiness is not None and not 0 <= args.swappiness <= 100:
        raise UsageError(f"--swappiness {args.swappiness} must be in 0..100")
    from infiniswap import cgroup
    why = cgroup.available()
    if why:
        print(f"infiniswap run: error: memory cgroups are unavailable: {why}", file=sys.stderr)
        return 1
    before = _vmstat_swap()
    t0 = time.monotonic()
    try:
        rc, stats = cgroup.run_limited(cmd, args.memory, swappiness=args.swappiness)
    except cgroup.CgroupError as exc:
        print(f"infiniswap run: error: {exc}", file=sys.stderr)
        return 1
    except FileNotFoundError as exc:
        print(f"infiniswap run: error: cannot run {cmd[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127
    elapsed = time.monotonic() - t0
    after = _vmstat_swap()
    parts = [f"exit {rc if rc >= 0 else signal.Signals(-rc).name}", f"{elapsed:.1f} s"]
    if "peak_bytes" in stats:
        parts.append(f"peak memory {format_size(stats['peak_bytes'])} "
                     f"(limit {format_size(args.memory)})")
    # cgroup v2 memory.stat counts its own swap traffic; v1 does not: system-wide deltas
    if "pswpin" in stats or "pswpout" in stats:
        parts.append(f"swap-ins {stats.get('pswpin', 0)} swap-outs {stats.get('pswpout', 0)} "
                     f"pages (cgroup)")
    elif before and after:
        parts.append(f"swap-ins {after['pswpin'] - before['pswpin']} swap-outs "
                     f"{after['pswpout'] - before['pswpout']} pages (system-wide /proc/vmstat)")
    if stats.get("swap"):
        parts.append(f"in swap at exit {format_size(stats['swap'])}")
    print("infiniswap run: " + ", ".join(parts), file=sys.stderr, flush=True)
    return rc if rc >= 0 else 128 - rc


# ---- parser ----

def _daemon_args(d: argparse.ArgumentParser) -> None:
    d.add_argument("--bind", type=cli.bind_address, default="127.0.0.1:7300", metavar="ADDR",
                   help="control endpoint, HOST:PORT or tcp://HOST:PORT (port 0 = any)")
    d.add_argument("--headroom", type=cli.size, default="8G",
                   help="free memory to keep for local applications")
    d.add_argument("--slab-size", type=cli.size, default="1G",
                   help="the unit of memory lent to a device (the devices' --slab-size must match)")
    d.add_argument("--capacity", type=cli.size, default=None,
                   help="most memory to lend (default: all of it above HeadRoom)")
    d.add_argument("--no-lock", action="store_true",
                   help="do not mlock slab memory (never on a host that swaps into Infiniswap)")
    d.add_argument("--no-harden", action="store_true",
                   help="as root the daemon mlocks itself, sets PR_SET_IO_FLUSHER and "
                        "oom_score_adj -1000 (its data server is on the paging path); skip that")
    d.add_argument("--exit-with-parent", action="store_true",
                   help="stop (SIGTERM) when the process that started this one dies (Linux)")
    d.add_argument("--period", type=_positive(float), default=1.0, help="memory monitor period, seconds")
    d.add_argument("--timeout", type=_positive(float), default=5.0,
                   help="wait this long (s) for ACTIVITY / DONE from a device, then take it as "
                        "gone; keep it above the devices' --timeout")
    d.add_argument("--data-host", default="127.0.0.1",
                   help="address of the TCP data server for devices on other hosts")
    d.add_argument("--data-port", type=int, default=0, help="TCP data server port (0 = any free port)")
    d.add_argument("--no-data-server", action="store_true",
                   help="no TCP data path (same-host devices only)")
    d.add_argument("--transport", choices=["auto", "tcp", "rdma"], default="auto",
                   help="auto and tcp: shared memory for devices on this host, the TCP data server "
                        "for the others; rdma: also lend every slab over RDMA (registered as a memory "
                        "region while lent; needs an RDMA device, fails at once without one; not run "
                        "on hardware yet, see docs/rdma.md)")
    d.add_argument("--emulate-usage", metavar="FILE",
                   help="testing: read the memory used by everything else from FILE "
                        "(bytes, e.g. 512M; re-read every period) and take --capacity as "
                        "the machine's memory")
    d.add_argument("--reports", type=cli.bind_address, metavar="ADDR", default=None,
                   help="publish utilization reports (ZeroMQ PUB, topic infiniswap.utilization; "
                        "see infiniswap/report.py) on ADDR, e.g. 127.0.0.1:5600 "
                        "(port 0 = any; the bound one is announced) (default: off)")
    d.add_argument("--report-interval", type=_positive(float), default=1.0, metavar="SECONDS",
                   help="seconds between reports and metrics updates")
    d.add_argument("--report-host", metavar="NAME", default=None,
                   help="host name in the reports and metrics (default: this machine's, "
                        "socket.gethostname(); lets daemons on one machine stand for "
                        "emulated hosts)")
    d.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                   help="serve Prometheus metrics on http://HOST:PORT/metrics, HOST being "
                        "--bind's host (0 = off)")
    g = d.add_argument_group("limits on peers that have not proved the cluster key "
                             "(infiniswap/limits.py; each also from its environment variable)")
    g.add_argument("--data-max-connections", type=_positive(int), default=None, metavar="N",
                   help="TCP data connections held at once; at the cap the oldest one that has "
                        "not proved the key is closed (default $INFINISWAP_DATA_MAX_CONNECTIONS, "
                        "else half the open-file limit, 16..4096)")
    g.add_argument("--data-handshake-timeout", type=_positive(float), default=None,
                   metavar="SECONDS",
                   help="close a data connection that has not proved the key within this "
                        "(default $INFINISWAP_DATA_HANDSHAKE_S, else 2)")
    g.add_argument("--control-max-peers", type=_positive(int), default=None, metavar="N",
                   help="control peers (ZeroMQ routing ids) remembered; past it the least "
                        "recently seen without leases is forgotten (default "
                        "$INFINISWAP_CTL_MAX_PEERS, else 4096)")
    g.add_argument("--control-peer-ttl", type=_positive(float), default=None, metavar="SECONDS",
                   help="forget a control peer unseen this long, unless it holds leases "
                        "(default $INFINISWAP_CTL_PEER_TTL_S, else 300)")
    g.add_argument("--control-rate", type=_positive(float), default=None, metavar="PER_S",
                   help="messages per second a peer that has not proved the key may send "
                        "(burst three seconds' worth); the rest are dropped (default "
                        "$INFINISWAP_CTL_RATE, else 100)")
    g.add_argument("--control-max-message", type=cli.size, default=None, metavar="BYTES",
                   help="largest control message accepted; a larger one closes its connection "
                        "(default $INFINISWAP_CTL_MAX_MESSAGE, else 64K)")


def _device_args(v: argparse.ArgumentParser) -> None:
    v.add_argument("--size", type=cli.size, required=True, help="device size, e.g. 4G")
    v.add_argument("--backup", required=True, help="backup file (created, size bytes)")
    v.add_argument("--daemons", type=cli.address_list, default=[], metavar="ADDR,...",
                   help="comma-separated daemon control addresses (HOST:PORT or tcp://HOST:PORT)")
    v.add_argument("--slab-size", type=cli.size, default="1G",
                   help="the unit of the device's space placed on one daemon (the daemons' --slab-size)")
    v.add_argument("--hot-slab", type=float, default=20.0,
                   help="page I/Os per second that make a slab hot")
    v.add_argument("--period", type=_positive(float), default=1.0, help="control loop period, seconds")
    v.add_argument("--timeout", type=_positive(float), default=2.0,
                   help="take a daemon as failed after this long (s) without an answer")
    v.add_argument("--transport", choices=["auto", "shm", "tcp", "rdma"], default="auto",
                   help="auto: shared memory with daemons on this host, TCP otherwise; shm or tcp: "
                        "only that; rdma: one-sided RDMA READ/WRITE of the daemons' slabs (daemons "
                        "started with --transport rdma; needs an RDMA device, fails at once without "
                        "one; not run on hardware yet, see docs/rdma.md)")
    v.add_argument("--status-bind", type=cli.bind_address, default=None, metavar="ADDR",
                   help="address where `infiniswap status --devices` can ask this device")
    v.add_argument("--device-id", default=None, help="name shown by daemons (default host:pid)")
    v.add_argument("--map-all", action="store_true", help="map every slab at start")
    v.add_argument("--mount", metavar="DIR", default=None,
                   help="serve the device as DIR/disk over FUSE (created if missing); "
                        "undo with SIGTERM or `infiniswap device stop --mount DIR`")
    v.add_argument("--loop", action="store_true",
                   help="attach DIR/disk as a loop device (direct I/O)")
    v.add_argument("--swap", action="store_true",
                   help="mkswap + swapon the loop device (implies --loop); refused when --size exceeds "
                        "the space available for --backup (without --swap: a warning)")
    v.add_argument("--swap-priority", type=int, default=None, metavar="N",
                   help="swapon --priority N (default: the kernel's)")
    v.add_argument("--no-harden", action="store_true",
                   help="with --mount the process mlocks itself, sets PR_SET_IO_FLUSHER and "
                        "oom_score_adj -1000; skip that")


def _parser() -> argparse.ArgumentParser:
    ap = cli.parser("infiniswap", "Infiniswap remote-memory paging (thesis ch. II)")
    sub = cli.add_commands(ap)

    d = cli.add_command(sub, "daemon", "lend this machine's free memory to devices")
    _daemon_args(d)
    d.set_defaults(run=_cmd_daemon)

    v = cli.add_command(sub, "device", "run a device's control loop (`device stop --mount DIR` stops one)")
    _device_args(v)
    v.set_defaults(run=_cmd_device)

    s = cli.add_command(sub, "status", "ask daemons and devices for their state",
                        json_help="write the answers as JSON to FILE ('-' for stdout instead of the table)")
    s.add_argument("--daemons", type=cli.address_list, default=None, metavar="ADDR,...",
                   help="daemons' control addresses")
    s.add_argument("--devices", type=cli.address_list, default=None, metavar="ADDR,...",
                   help="devices' --status-bind addresses")
    s.add_argument("--timeout", type=_positive(float), default=2.0, help="seconds to wait for each answer")
    s.set_defaults(run=_cmd_status)

    r = cli.add_command(sub, "run", "run a command in a memory-limited cgroup",
                        description="run CMD in a new memory-limited cgroup (it pages to whatever swap is "
                                    "active, e.g. an `infiniswap device --swap`); prints peak memory and "
                                    "swap-ins/outs on stderr at the end and exits with CMD's status")
    r.add_argument("--memory", type=cli.size, required=True, help="memory limit of the cgroup, e.g. 64M")
    r.add_argument("--swappiness", type=int, default=None, metavar="N",
                   help="memory.swappiness of the cgroup (cgroup v1 only; 0..100)")
    r.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD...", help="the command to run in the cgroup")
    r.set_defaults(run=_cmd_run)

    for name, (_, text) in FORWARDED.items():      # their own parsers read the rest
        x = sub.add_parser(name, help=text, add_help=False)
        x.set_defaults(run=None)
    return ap


def _stop_parser() -> argparse.ArgumentParser:
    ap = cli.parser(
        "infiniswap device stop",
        "stop the device serving a mount: SIGTERM it and wait for its cleanup; if it is gone "
        "(crashed, killed), undo what it left (swapoff, losetup -d, unmount)")
    ap.add_argument("--mount", required=True, metavar="DIR", help="the device's --mount DIR")
    ap.add_argument("--timeout", type=_positive(float), default=120.0,
                    help="wait this long (s) for the device to clean up")
    cli.add_log_level(ap)
    ap.set_defaults(run=_cmd_device_stop, command="device stop")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["device", "stop"]:
        args = _stop_parser().parse_args(argv[2:])
    else:
        ap = _parser()
        args, rest = ap.parse_known_args(argv)
        if args.command is None:
            return cli.no_subcommand(ap)
        if args.command in FORWARDED:
            module, _ = FORWARDED[args.command]
            return importlib.import_module(module).main(rest)
        if rest:
            ap.error(f"unrecognized arguments: {' '.join(rest)}")
    cli.setup_logging(args.log_level, LOG_FORMAT)
    return cli.run_main(f"infiniswap {args.command}", args.run, args)


if __name__ == "__main__":
    raise SystemExit(main())
