"""TCP loss on emulated hosts over a benchmark run: each host's retransmissions, retransmission
timeouts, tail-loss probes and reordering detected, sampled from ``/proc/PID/net/{snmp,netstat}`` of one process on
the host (those files show the counters of the reading process's network namespace, so no
namespace has to be entered), with the machine's backlog drops (``/proc/net/softnet_stat``:
packets a veth handed to a CPU's full input queue), and attributed to time windows afterwards.

A stall that a retransmission timeout causes (200 ms at least on Linux) shows as a timeout on
the sending host in the window; a loss recovered fast shows as retransmitted segments only.
"""
from __future__ import annotations

import functools
from typing import Callable

from .sampler import PeriodicSampler, read_text

# the counters kept, by the table of /proc/PID/net/{snmp,netstat} they are in
SNMP = {"Tcp": ("RetransSegs", "OutSegs")}
NETSTAT = {"TcpExt": ("TCPTimeouts", "TCPLossProbes", "TCPSlowStartRetrans", "TCPSACKReorder")}
SOFTNET_DROPS = "softnet_drops"
FIELDS = tuple(name for table in (SNMP, NETSTAT) for names in table.values() for name in names)

Counters = dict[str, int]


def _tables(text: str, wanted: dict[str, tuple[str, ...]]) -> Counters:
    """The ``wanted`` fields of a ``/proc/net/snmp``-style text (a header line and a value
    line per table); only the wanted tables' value lines are split, at the positions their
    header line gives (``_positions``, worked out once per header)."""
    out: Counters = {}
    lines = text.splitlines()
    for head, values in zip(lines[::2], lines[1::2]):
        fields = wanted.get(head[:head.find(":")])
        if fields:
            row = values.split()
            out.update({name: int(row[i]) for name, i in _positions(head, fields)})
    return out


@functools.lru_cache(maxsize=64)
def _positions(head: str, fields: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    """Where each of ``fields`` is on a table's value line (``head``: its header line; the
    table's name comes first on both lines); fields the header lacks left out."""
    names = head.split()
    return tuple((name, names.index(name)) for name in fields if name in names)


def host_counters(pid: int, read: Callable[[str], str] = read_text) -> Counters:
    """TCP counters of the network namespace process ``pid`` is in (``OSError`` once it is
    gone); ``read`` reads a file's text (a sampler's ``ProcFiles.read``)."""
    return {**_tables(read(f"/proc/{pid}/net/snmp"), SNMP), **_tables(read(f"/proc/{pid}/net/netstat"), NETSTAT)}


def softnet_drops(path: str = "/proc/net/softnet_stat", read: Callable[[str], str] = read_text) -> int:
    """Packets dropped because a CPU's input backlog was full, summed over CPUs (the second
    column, hexadecimal)."""
    return sum(int(line.split()[1], 16) for line in read(path).splitlines() if line.strip())


class TcpLossSampler(PeriodicSampler):
    """Samples ``host_counters`` of ``pids`` (host name -> a pid on that host) and
    ``softnet_drops`` every ``interval`` seconds on a thread, from ``start`` to ``stop``;
    ``window(t0, t1)`` is what changed between them (``window_delta``)."""

    name = "tcp-loss"

    def __init__(self, pids: dict[str, int], interval: float = 0.02) -> None:
        super().__init__(interval)
        self.pids = dict(pids)

    def read(self) -> dict[str, Counters]:
        sample: dict[str, Counters] = {}
        for host, pid in self.pids.items():
            try:
                sample[host] = host_counters(pid, self.files.read)
            except (OSError, ValueError):
                pass                      # the process ended: its host's counters stop here
        try:
            sample[""] = {SOFTNET_DROPS: softnet_drops(read=self.files.read)}
        except (OSError, ValueError, IndexError):
            pass
        return sample

    def delta(self, a: dict[str, Counters], b: dict[str, Counters]) -> dict:
        """The totals over hosts, ``softnet_drops``, and ``by_host`` for the hosts that
        retransmitted."""
        return window_delta(a, b)


def window_delta(a: dict[str, Counters], b: dict[str, Counters]) -> dict:
    """What ``window`` reports for two samples ``a`` (earlier) and ``b``."""
    totals = {k: 0 for k in FIELDS}
    by_host: dict[str, Counters] = {}
    for host, counters in b.items():
        if not host or host not in a:
            continue
        delta = {k: counters[k] - a[host][k] for k in FIELDS if k in counters and k in a[host]}
        for k, v in delta.items():
            totals[k] += v
        if delta.get("RetransSegs"):
            by_host[host] = {k: v for k, v in delta.items() if v and k != "OutSegs"}
    drops = b.get("", {}).get(SOFTNET_DROPS, 0) - a.get("", {}).get(SOFTNET_DROPS, 0)
    return {**totals, SOFTNET_DROPS: drops, "by_host": by_host}
