"""Emulated hosts on one machine (DESIGN §9): network namespaces on one bridge, shaped links.

``Testbed(hosts=3, link="1gbit", delay="50us", prefix="dlrt")`` builds, with ``ip`` and ``tc``:

- a bridge ``{prefix}-br`` that carries no address (so the root namespace has no route into
  the testbed, and two testbeds never clash even if their subnets did);
- per host ``i`` a namespace ``{prefix}-h{i}`` with ``lo`` up and a veth ``eth0`` holding
  ``10.213.X.(i+1)/24`` (``X`` derived from the prefix), whose peer ``{prefix}-v{i}`` is a
  port of the bridge. No default route, no NAT, no IPv6 addresses: a host reaches the other
  hosts and nothing else, and every byte between two hosts crosses both hosts' links;
- per host link, in both directions (egress of ``eth0`` = the host's upload, egress of
  ``{prefix}-v{i}`` = its download): ``tbf`` at the link rate and, when ``delay`` is given,
  ``netem`` with half the delay (root) above the ``tbf`` (child), so two hosts are ``delay``
  apart one way and a ping between them shows about ``2 x delay``;
- per host its TCP congestion control (``congestion``, default ``cubic``, the kernel's own
  default: a namespace would otherwise inherit this machine's);
- unless ``rps=False``, on both ends of every veth, receive packet steering over all CPUs
  (``rps_cpus``), so each flow's packets are processed on one CPU, in order. Without it a
  veth hands each packet to the backlog of whichever CPU sent it (or released it from
  ``tbf``), two CPUs process one flow's packets at once, and the receiver sees them
  reordered, which no real link does: TCP then retransmits in vain (nearly every
  retransmission answered by a D-SACK) and falls into 200 ms timeouts. The steering costs
  CPU (inter-processor interrupts), which on a small machine slows what runs on it.

``Host.popen`` / ``Host.run`` start processes inside a host (``ip netns exec``; ``nsenter
--net`` with ``mount_visible`` so a FUSE mount made inside stays visible outside) with
``DLRT_HOST_ID`` set to the host's own id, so ``auto`` transports never pick ipc or shared
memory between emulated hosts (namespaces share the hostname, boot id, unix sockets and
``/dev/shm``). ``down()`` stops those processes (their process groups), kills whatever else
still runs in the namespaces and removes everything; ``cleanup(prefix)`` does the removal for
a testbed whose owner died (found by name prefix). ``available()`` says why none can be built.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
import zlib
from typing import Any, Mapping, NamedTuple, Sequence

from dlrt.hostid import HOST_ID_ENV
from dlrt.procs import signal_group

__all__ = ["Testbed", "Host", "Counters", "TestbedError", "available", "cleanup", "enter_netns", "leftovers",
           "parse_rate", "parse_delay", "check_prefix", "subnet_of", "shaping_commands",
           "congestion_controls", "rps_mask", "add_rps_option", "DEFAULT_PREFIX", "DEFAULT_CONGESTION"]

DEFAULT_PREFIX = "dlrt"
NETNS_DIR = "/run/netns"
HOST_IFNAME = "eth0"          # the host's side of its link, inside its namespace
MAX_HOSTS = 250               # addresses .1 .. .250 of the /24; veth names stay <= 15 chars
SUBNET_BASE = "10.213"
# tbf: the bucket holds at least two 64 KiB GSO packets (smaller buckets make tbf split
# them, costing CPU and throughput) and 5 ms of traffic at the rate, so a sender or receiver
# kept off the CPU for up to 5 ms (a loaded 2-core machine) loses no tokens (with 2 ms, 1 Gbit/s
# fell to 0.86 under load); the queue holds 5 ms of traffic beyond the bucket.
TBF_MIN_BURST_BYTES = 256 * 1024
TBF_BURST_SECONDS = 0.005
TBF_LATENCY = "5ms"
NETEM_LIMIT_PACKETS = 10000   # netem's default 1000 packets is too few at 10 Gbit/s
# TCP congestion control of every connection between emulated hosts (set on each host's
# route). A new namespace inherits the machine's (bbr on some kernels); the hosts get the
# Linux kernel's default instead, what most cluster hosts run. It matters: with bbr, four
# workers pushing into one aggregator's shallow switch queue (the tbf above) lose packets
# that bbr does not back off for (measured, W = A = 4 at 1 Gbit/s, flat64m: AutoPS 0.88 s
# per iteration with bbr, 0.78 s with cubic; gloo's ring, one flow per link, 0.93 s and
# 0.91 s).
DEFAULT_CONGESTION = "cubic"
PROBE_PREFIX = "dlrtprobe"

_PREFIX = re.compile(r"[a-z][a-z0-9]{0,9}")
_RATE = re.compile(r"(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps)", re.IGNORECASE)
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
               "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9}
_DELAY = re.compile(r"(\d+(?:\.\d+)?)\s*(s|ms|us|ns)", re.IGNORECASE)
_DELAY_US = {"s": 1e6, "ms": 1e3, "us": 1.0, "ns": 1e-3}


class TestbedError(RuntimeError):
    """A command that builds, inspects or removes a testbed failed (names the command)."""

    __test__ = False  # not a pytest test class


class Counters(NamedTuple):
    """Bytes a host sent and received over its link (its bridge-side veth's counters)."""
    sent: int
    received: int


def parse_rate(text: str) -> int:
    """A link rate in ``tc``'s words (``1gbit``, ``100mbit``, ``125mbps`` = bytes/s) -> bit/s."""
    match = _RATE.fullmatch(str(text).strip())
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"bad link rate {text!r}: expected a rate such as 100mbit, 1gbit or 10gbit")
    return int(float(match.group(1)) * _RATE_UNITS[match.group(2).lower()])


def parse_delay(text: str) -> float:
    """A one-way delay (``50us``, ``1ms``, ``0.5ms``) -> microseconds."""
    match = _DELAY.fullmatch(str(text).strip())
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"bad delay {text!r}: expected a duration above 0 such as 50us or 2ms")
    return float(match.group(1)) * _DELAY_US[match.group(2).lower()]


def check_prefix(prefix: str) -> str:
    """``prefix`` if it can name a testbed (a lower-case letter, then up to 9 letters or digits)."""
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
        raise ValueError(f"bad testbed prefix {prefix!r}: expected a lower-case letter followed by "
                         "at most 9 lower-case letters or digits")
    return prefix


def subnet_of(prefix: str) -> str:
    """The testbed's /24, ``10.213.X.0/24`` with ``X`` (1..254) derived from the prefix."""
    return f"{SUBNET_BASE}.{1 + zlib.crc32(check_prefix(prefix).encode()) % 254}.0/24"


def _command(argv: Sequence[str]) -> str:
    """The output of a command; ``TestbedError`` naming it and its stderr when it fails."""
    argv = list(argv)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except OSError as exc:
        raise TestbedError(f"`{shlex.join(argv)}` could not run: {exc}") from None
    if done.returncode != 0:
        message = " ".join(done.stderr.split()) or "no message"
        raise TestbedError(f"`{shlex.join(argv)}` failed (exit {done.returncode}): {message}")
    return done.stdout


def _ip(*args: str, netns: str | None = None) -> str:
    return _command(["ip", *(["-n", netns] if netns else []), *args])


def _tc(*args: str, netns: str | None = None) -> str:
    return _command(["tc", *(["-n", netns] if netns else []), *args])


def rps_mask(cpus: int) -> str:
    """The kernel's text for a mask of CPUs ``0 .. cpus-1``: hex, a comma every 32 bits."""
    if cpus < 1:
        raise ValueError(f"need at least one CPU, got {cpus}")
    digits = format((1 << cpus) - 1, "x")
    head = len(digits) % 8 or 8
    return ",".join([digits[:head]] + [digits[i:i + 8] for i in range(head, len(digits), 8)])


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


def add_rps_option(parser: argparse.ArgumentParser, scope: str = "") -> None:
    """``--rps on|off`` (default on), parsed to the bool ``Testbed(rps=...)`` takes; ``scope``
    starts its help (``"emulated hosts: "``)."""
    parser.add_argument("--rps", type=_on_off, default="on", metavar="on|off",
                        help=f"{scope}receive packet steering on every link, keeping each flow's packets in "
                             "order; off saves the CPU it costs, and links then reorder packets (docs/testbed.md)")


def _steer_receive(dev: str, mask: str, netns: str | None = None) -> None:
    """Write ``mask`` to the ``rps_cpus`` of every receive queue of ``dev`` (the sysfs of
    ``netns``, seen through ``ip netns exec``, which mounts that namespace's sysfs)."""
    script = (f"for q in /sys/class/net/{dev}/queues/rx-*/rps_cpus; do "
              f"[ -e \"$q\" ] || continue; echo {mask} > \"$q\" || exit 1; done")
    _command([*(["ip", "netns", "exec", netns] if netns else []), "sh", "-c", script])


def congestion_controls() -> list[str]:
    """The TCP congestion controls this kernel offers (built in or loaded)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_available_congestion_control", encoding="ascii") as fh:
            return fh.read().split()
    except OSError:
        return []


def _tbf(rate_bps: int) -> list[str]:
    burst = max(TBF_MIN_BURST_BYTES, int(rate_bps / 8 * TBF_BURST_SECONDS))
    return ["tbf", "rate", f"{rate_bps}bit", "burst", str(burst), "latency", TBF_LATENCY]


def _netem(delay_us: float) -> list[str]:
    return ["netem", "delay", f"{delay_us:.3f}us", "limit", str(NETEM_LIMIT_PACKETS)]


def shaping_commands(rate_bps: int | None, delay_us: float | None, dev: str) -> list[list[str]]:
    """The ``tc`` arguments that shape one direction of a link: ``tbf`` alone, ``netem``
    alone (``delay_us`` is this direction's share), or ``netem`` with a ``tbf`` child."""
    root = ["qdisc", "add", "dev", dev, "root", "handle", "1:"]
    if delay_us is None:
        return [root + _tbf(rate_bps)] if rate_bps is not None else []
    commands = [root + _netem(delay_us)]
    if rate_bps is not None:
        commands.append(["qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *_tbf(rate_bps)])
    return commands


def _netns_names() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _link_names() -> list[str]:
    return [link["ifname"] for link in json.loads(_ip("-j", "link", "show") or "[]")]


def _host_index(prefix: str, netns: str) -> int | None:
    match = re.fullmatch(re.escape(prefix) + r"-h(\d+)", netns)
    return int(match.group(1)) if match else None


def _is_testbed_link(prefix: str, ifname: str) -> bool:
    return re.fullmatch(re.escape(prefix) + r"-(br|v\d+)", ifname) is not None


def _existing(prefix: str) -> tuple[list[str], list[str]]:
    """The namespaces and the links (veths, bridge) of testbed ``prefix`` that exist now."""
    check_prefix(prefix)
    return ([n for n in _netns_names() if _host_index(prefix, n) is not None],
            [name for name in _link_names() if _is_testbed_link(prefix, name)])


def _labels(namespaces: Sequence[str], links: Sequence[str]) -> list[str]:
    return [f"netns {n}" for n in namespaces] + [f"link {name}" for name in links]


def leftovers(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """The namespaces and links of testbed ``prefix`` that exist now (empty: none), as
    ``"netns NAME"`` and ``"link NAME"``."""
    return _labels(*_existing(prefix))


def _pids_in(namespaces: Sequence[str]) -> list[int]:
    """Processes whose network namespace is one of ``namespaces`` (what ``ip netns pids`` does)."""
    inodes = set()
    for netns in namespaces:
        try:
            st = os.stat(os.path.join(NETNS_DIR, netns))
            inodes.add((st.st_dev, st.st_ino))
        except OSError:
            continue
    pids = []
    for entry in os.listdir("/proc") if inodes else ():
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in inodes:
            pids.append(int(entry))
    return pids


def _kill_processes_in(namespaces: Sequence[str], timeout: float = 5.0) -> None:
    """SIGKILL every process still in ``namespaces`` and wait (up to ``timeout``) until none is
    left: a namespace with a process in it outlives ``ip netns del``."""
    deadline = time.monotonic() + timeout
    while (pids := _pids_in(namespaces)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def _delete(args: Sequence[str], path: str) -> None:
    """``ip ARGS`` deleting the thing at ``path``; fine if it went meanwhile (a veth goes with
    its peer, another process may be cleaning up the same testbed)."""
    try:
        _ip(*args)
    except TestbedError:
        if os.path.exists(path):
            raise


def cleanup(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Remove everything testbed ``prefix`` left behind, found by name: kill the processes in
    its namespaces, delete its veths, namespaces and bridge. Returns what was removed."""
    namespaces, links = _existing(prefix)
    _kill_processes_in(namespaces)
    bridge = f"{prefix}-br"
    for name in sorted(links, key=lambda name: name == bridge):   # the bridge last
        _delete(["link", "del", "dev", name], f"/sys/class/net/{name}")
    for netns in namespaces:
        _delete(["netns", "del", netns], os.path.join(NETNS_DIR, netns))
    return _labels(namespaces, links)


@functools.lru_cache(maxsize=None)
def available(delay: bool = False) -> str | None:
    """``None`` when a testbed can be built here (with link delays too when ``delay``), else
    the reason: not root, ``ip``/``tc``/``nsenter`` missing, namespaces, veths, bridges or
    ``tbf`` (``netem``) refused. Probed once per process in a scratch namespace."""
    if os.geteuid() != 0:
        return f"emulated hosts need root (network namespaces, veths, tc); running as uid {os.geteuid()}"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("nsenter", "util-linux")):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (install {package})"
    probe = f"{PROBE_PREFIX}-h{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except TestbedError as exc:
        return f"network namespaces are not permitted here: {exc}"
    try:
        _ip("link", "add", "name", "probe0", "type", "veth", "peer", "name", "probe1", netns=probe)
        _ip("link", "add", "name", "probebr", "type", "bridge", netns=probe)
        _tc("qdisc", "add", "dev", "probe0", "root", *_tbf(10**9), netns=probe)
        if delay:
            try:
                _tc("qdisc", "add", "dev", "probe1", "root", *_netem(500.0), netns=probe)
            except TestbedError as exc:
                lacks = "which this kernel lacks (CONFIG_NET_SCH_NETEM)" if "unknown" in str(exc) else "refused"
                return f"link delays need the netem qdisc, {lacks}: {exc}"
    except TestbedError as exc:
        return f"cannot build emulated hosts here: {exc}"
    finally:
        _ip("netns", "del", probe)
    return None


def _signal(proc: subprocess.Popen, own_group: bool, sig: int) -> None:
    """Signal a process started on a host: its whole group when it leads one."""
    if own_group:
        signal_group(proc.pid, sig)
    elif proc.poll() is None:
        proc.send_signal(sig)


class ProcessTracker:
    """The processes started on a testbed's hosts; ``stop`` ends them and their process groups."""

    def __init__(self) -> None:
        self._procs: list[tuple[subprocess.Popen, bool]] = []

    def add(self, proc: subprocess.Popen, own_group: bool) -> None:
        """Track ``proc``; forget those that ended with nothing left in their group."""
        self._procs = [(p, group) for p, group in self._procs
                       if p.poll() is None or (group and signal_group(p.pid, 0))]
        self._procs.append((proc, own_group))

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM each (its whole group when it leads one), wait up to ``timeout`` for all
        together, then SIGKILL what is left of each group and reap the processes."""
        procs, self._procs = self._procs, []
        for proc, own_group in procs:
            if proc.poll() is None:
                _signal(proc, own_group, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc, _ in procs:
            try:
                proc.wait(max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc, own_group in procs:
            _signal(proc, own_group, signal.SIGKILL)
            proc.wait()



_CLONE_NEWNET = 0x40000000


def enter_netns(netns: str) -> None:
    """Move the calling thread into network namespace ``netns`` (a name under ``/run/netns``).

    Threads it starts afterwards (ZeroMQ's I/O threads among them) are there too, so a
    process can reach an emulated host's addresses from one thread while its others stay
    where they were (``setns(2)``; root)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(NETNS_DIR, netns), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {netns}: {os.strerror(err)}")
    finally:
        os.close(fd)


class Host:
    """One emulated host: its namespace, its address on the bridge, its identity and link."""

    def __init__(self, prefix: str, index: int, tracker: ProcessTracker) -> None:
        self.index = index
        self.name = f"{prefix}-h{index}"
        self.netns = self.name
        self.addr = subnet_of(prefix).rsplit(".", 1)[0] + f".{index + 1}"
        self.host_id = self.name
        self.ifname = f"{prefix}-v{index}"
        self._tracker = tracker

    def __repr__(self) -> str:
        return f"Host({self.name!r}, addr={self.addr!r}, ifname={self.ifname!r})"

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """This process's environment plus ``extra``, with ``DLRT_HOST_ID`` set to this host."""
        return {**os.environ, **(extra or {}), HOST_ID_ENV: self.host_id}

    def enter(self) -> None:
        """Make the calling thread (and the threads it starts) part of this host: its network
        namespace (``enter_netns``) and, for the whole process, its ``DLRT_HOST_ID``. For a
        process started outside that runs as this host from its first line on."""
        enter_netns(self.netns)
        os.environ[HOST_ID_ENV] = self.host_id

    def command(self, argv: Sequence[str] | str, mount_visible: bool = False) -> list[str]:
        """``argv`` wrapped to run in this host's network namespace."""
        if mount_visible:
            wrapper = ["nsenter", f"--net={os.path.join(NETNS_DIR, self.netns)}", "--"]
        else:
            wrapper = ["ip", "netns", "exec", self.netns]
        return wrapper + [os.fspath(argv)] if isinstance(argv, (str, os.PathLike)) \
            else wrapper + [os.fspath(arg) for arg in argv]

    def popen(self, argv: Sequence[str] | str, env: Mapping[str, str] | None = None,
              mount_visible: bool = False, **popen_kw: Any) -> subprocess.Popen:
        """Start ``argv`` in this host (``subprocess.Popen``'s keywords apply). ``env`` defaults
        to ``self.env()``; a given ``env`` gets this host's ``DLRT_HOST_ID`` too. The process
        leads a new session (unless ``start_new_session=False``) and is stopped, with its group,
        by the testbed's ``down()``. ``mount_visible``: enter only the network namespace, so a
        mount made by the process stays visible outside."""
        env = self.env() if env is None else {**env, HOST_ID_ENV: self.host_id}
        popen_kw.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(argv, mount_visible), env=env, **popen_kw)
        self._tracker.add(proc, own_group=bool(popen_kw["start_new_session"]))
        return proc

    def run(self, argv: Sequence[str] | str, *, input: Any = None, timeout: float | None = None,
            check: bool = False, capture_output: bool = False, **popen_kw: Any
            ) -> subprocess.CompletedProcess:
        """``subprocess.run`` in this host (through ``popen``): its process group is killed
        when ``timeout`` expires or the wait is interrupted."""
        if capture_output:
            popen_kw.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if input is not None:
            popen_kw["stdin"] = subprocess.PIPE
        proc = self.popen(argv, **popen_kw)
        try:
            out, err = proc.communicate(input, timeout)
        except BaseException:
            _signal(proc, bool(popen_kw.get("start_new_session", True)), signal.SIGKILL)
            proc.wait()
            raise
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check:
            done.check_returncode()
        return done


class Testbed:
    """``hosts`` emulated hosts on one bridge, each link shaped to ``link`` (``None``:
    unshaped) and ``delay`` (one way between two hosts; ``None``: none), each flow's packets
    kept in order by receive packet steering unless ``rps=False``. A context manager:
    ``up()`` on entry, ``down()`` on exit."""

    __test__ = False  # not a pytest test class

    def __init__(self, hosts: int, link: str | None = "1gbit", delay: str | None = None,
                 prefix: str = DEFAULT_PREFIX, congestion: str = DEFAULT_CONGESTION, rps: bool = True) -> None:
        if isinstance(hosts, bool) or not isinstance(hosts, int) or not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"bad number of hosts {hosts!r}: expected 1..{MAX_HOSTS}")
        if not re.fullmatch(r"[a-z0-9_]{1,16}", congestion or ""):
            raise ValueError(f"bad TCP congestion control {congestion!r}")
        self.prefix = check_prefix(prefix)
        self.link = link
        self.delay = delay
        self.congestion = congestion
        self.rps = rps
        self.rate_bps = parse_rate(link) if link is not None else None
        self.delay_us = parse_delay(delay) if delay is not None else None
        self.bridge = f"{prefix}-br"
        self.subnet = subnet_of(prefix)
        self._tracker = ProcessTracker()
        self.hosts = [Host(prefix, i, self._tracker) for i in range(hosts)]

    def __repr__(self) -> str:
        return (f"Testbed(hosts={len(self.hosts)}, link={self.link!r}, delay={self.delay!r}, "
                f"prefix={self.prefix!r}, congestion={self.congestion!r}, rps={self.rps!r})")

    def __enter__(self) -> "Testbed":
        return self.up()

    def __exit__(self, *exc: Any) -> None:
        self.down()

    @property
    def description(self) -> str:
        """What the bridge's alias records: ``hosts=N link=L delay=D cc=C rps=on|off`` (read back
        by ``attach``)."""
        return (f"hosts={len(self.hosts)} link={self.link or 'none'} delay={self.delay or 'none'} "
                f"cc={self.congestion} rps={'on' if self.rps else 'off'}")

    def up(self) -> "Testbed":
        """Create the bridge, the hosts and the shaping. Refuses when anything named after the
        prefix exists already; removes what it made when a step fails."""
        if self.delay_us is not None and (reason := available(delay=True)):
            raise TestbedError(reason)
        offered = congestion_controls()
        if self.congestion not in offered:
            raise TestbedError(f"TCP congestion control {self.congestion!r} is not available here "
                               f"(available: {' '.join(offered) or 'unknown'})")
        existing = leftovers(self.prefix)
        if existing:
            raise TestbedError(f"testbed {self.prefix!r} exists already ({', '.join(existing)}): "
                               f"`dlrt testbed down --prefix {self.prefix}` removes it")
        # the bridge's name is the testbed's lock: whoever created it owns the prefix
        _ip("link", "add", "name", self.bridge, "type", "bridge")
        try:
            _ip("link", "set", self.bridge, "addrgenmode", "none", "alias", self.description)
            _ip("link", "set", self.bridge, "up")
            for host in self.hosts:
                self._add_host(host)
        except BaseException:
            with contextlib.suppress(Exception):   # the failure that matters is the first one
                self.down()
            raise
        return self

    def _add_host(self, host: Host) -> None:
        ns = host.netns
        _ip("netns", "add", ns)
        _ip("link", "add", "name", host.ifname, "type", "veth", "peer", "name", HOST_IFNAME, "netns", ns)
        _ip("link", "set", host.ifname, "addrgenmode", "none")   # no IPv6 link-local chatter
        _ip("link", "set", host.ifname, "master", self.bridge, "up")
        _ip("link", "set", "lo", "up", netns=ns)
        _ip("link", "set", HOST_IFNAME, "addrgenmode", "none", netns=ns)
        _ip("addr", "add", f"{host.addr}/24", "dev", HOST_IFNAME, netns=ns)
        _ip("link", "set", HOST_IFNAME, "up", netns=ns)
        # on the host's one route, not the namespace's sysctl: a namespace other than the
        # machine's own may only pick from net.ipv4.tcp_allowed_congestion_control (EPERM for
        # cubic where the machine allows only reno and bbr); a route's congctl has no such limit
        _ip("route", "replace", subnet_of(self.prefix), "dev", HOST_IFNAME, "proto", "kernel",
            "scope", "link", "src", host.addr, "congctl", self.congestion, netns=ns)
        if self.rps:
            mask = rps_mask(os.cpu_count() or 1)
            _steer_receive(HOST_IFNAME, mask, netns=ns)
            _steer_receive(host.ifname, mask)
        half_delay = self.delay_us / 2 if self.delay_us is not None else None
        for args in shaping_commands(self.rate_bps, half_delay, HOST_IFNAME):
            _tc(*args, netns=ns)                       # the host's upload
        for args in shaping_commands(self.rate_bps, half_delay, host.ifname):
            _tc(*args)                                 # the host's download

    def down(self, timeout: float = 5.0) -> list[str]:
        """Stop the processes started on the hosts (SIGTERM, then SIGKILL after ``timeout``),
        then ``cleanup``. Safe to call more than once; returns what was removed."""
        self._tracker.stop(timeout)
        return cleanup(self.prefix)

    def host(self, key: int | str) -> Host:
        """A host by index (``0``, ``"0"``), short name (``"h0"``) or name (``"dlrt-h0"``)."""
        text = str(key)
        for host in self.hosts:
            if text in (str(host.index), f"h{host.index}", host.name):
                return host
        raise ValueError(f"no host {key!r} in testbed {self.prefix!r} "
                         f"(hosts: {', '.join(h.name for h in self.hosts)})")

    def counters(self, host: Host | int | str) -> Counters:
        """Bytes the host sent and received over its link so far (Ethernet frames, counted on
        its bridge-side veth, so only traffic that crossed the bridge)."""
        ifname = (host if isinstance(host, Host) else self.host(host)).ifname
        stats = f"/sys/class/net/{ifname}/statistics"
        with open(f"{stats}/rx_bytes", encoding="ascii") as rx, open(f"{stats}/tx_bytes", encoding="ascii") as tx:
            return Counters(sent=int(rx.read()), received=int(tx.read()))

    def blackout(self, host: Host | int | str, seconds: float) -> threading.Timer:
        """Drop every packet to ``host`` for ``seconds``: its download's queue (outside the
        host) is swapped for one that holds nothing, so segments in flight and the probes after
        them are lost, as on a link that flapped. Returns the started timer that puts the
        link's shaping back (``join`` it to wait)."""
        ifname = (host if isinstance(host, Host) else self.host(host)).ifname
        half_delay = self.delay_us / 2 if self.delay_us is not None else None
        restore = [[("replace" if arg == "add" else arg) for arg in cmd]
                   for cmd in shaping_commands(self.rate_bps, half_delay, ifname)]

        def back() -> None:
            if not restore:                            # an unshaped link: the default queue
                _tc("qdisc", "del", "dev", ifname, "root")
            for args in restore:
                _tc(*args)

        _tc("qdisc", "replace", "dev", ifname, "root", "handle", "2:", "pfifo", "limit", "0")
        timer = threading.Timer(seconds, back)
        timer.start()
        return timer

    def pids(self, host: Host | int | str) -> list[int]:
        """Every process now in the host's namespace (started through the testbed or not)."""
        return _pids_in([(host if isinstance(host, Host) else self.host(host)).netns])

    @classmethod
    def attach(cls, prefix: str = DEFAULT_PREFIX) -> "Testbed":
        """The testbed ``prefix`` that is up now (made by another process, e.g. ``dlrt testbed
        up``), to run processes in or read counters of; its ``down()`` removes it."""
        try:
            with open(f"/sys/class/net/{check_prefix(prefix)}-br/ifalias", encoding="utf-8") as fh:
                fields = dict(part.split("=", 1) for part in fh.read().split() if "=" in part)
        except OSError:
            raise TestbedError(f"no testbed {prefix!r} is up (no bridge {prefix}-br)") from None
        indices = sorted(i for n in _netns_names() if (i := _host_index(prefix, n)) is not None)
        try:
            tb = cls(int(fields["hosts"]), link=None if fields["link"] == "none" else fields["link"],
                     delay=None if fields["delay"] == "none" else fields["delay"], prefix=prefix,
                     congestion=fields.get("cc", DEFAULT_CONGESTION), rps=fields.get("rps") == "on")
        except (KeyError, ValueError):
            raise TestbedError(f"bridge {prefix}-br is not a testbed's (alias {fields})") from None
        if indices != list(range(len(tb.hosts))):
            raise TestbedError(f"testbed {prefix!r} is incomplete (namespaces for hosts {indices}, "
                               f"expected {len(tb.hosts)}): `dlrt testbed down --prefix {prefix}`")
        return tb
