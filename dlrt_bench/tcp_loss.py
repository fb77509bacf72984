"""TCP loss on emulated hosts over a benchmark run: each host's retransmissions, retransmission
timeouts, tail-loss probes and reordering detected, sampled from ``/proc/PID/net/{snmp,netstat}`` of one process on
the host (those files show the counters of the reading process's network namespace, so no
namespace has to be entered), with the machine's backlog drops (``/proc/net/softnet_stat``:
packets a veth handed to a CPU's full input queue), and attributed to time windows afterwards.

A stall that a retransmission timeout causes (200 ms at least on Linux) shows as a timeout on
the sending host in the window; a loss recovered fast shows as retransmitted segments only.
"""
from __future__ import annotations

from .sampler import PeriodicSampler

# the counters kept, by the table of /proc/PID/net/{snmp,netstat} they are in
SNMP = {"Tcp": ("RetransSegs", "OutSegs")}
NETSTAT = {"TcpExt": ("TCPTimeouts", "TCPLossProbes", "TCPSlowStartRetrans", "TCPSACKReorder")}
SOFTNET_DROPS = "softnet_drops"
FIELDS = tuple(name for table in (SNMP, NETSTAT) for names in table.values() for name in names)

Counters = dict[str, int]


def _tables(path: str, wanted: dict[str, tuple[str, ...]]) -> Counters:
    """The ``wanted`` fields of a ``/proc/net/snmp``-style file (a header line and a value
    line per table)."""
    out: Counters = {}
    with open(path) as f:
        lines = f.read().splitlines()
    for head, values in zip(lines[::2], lines[1::2]):
        table, _, names = head.partition(":")
        if table in wanted:
            row = dict(zip(names.split(), values.partition(":")[2].split()))
            out.update({k: int(row[k]) for k in wanted[table] if k in row})
    return out


def host_counters(pid: int) -> Counters:
    """TCP counters of the network namespace process ``pid`` is in (``OSError`` once it is gone)."""
    return {**_tables(f"/proc/{pid}/net/snmp", SNMP), **_tables(f"/proc/{pid}/net/netstat", NETSTAT)}


def softnet_drops(path: str = "/proc/net/softnet_stat") -> int:
    """Packets dropped because a CPU's input backlog was full, summed over CPUs (the second
    column, hexadecimal)."""
    with open(path) as f:
        return sum(int(line.split()[1], 16) for line in f if line.strip())


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
                sample[host] = host_counters(pid)
            except (OSError, ValueError):
                pass                      # the process ended: its host's counters stop here
        try:
            sample[""] = {SOFTNET_DROPS: softnet_drops()}
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
