"""An aggregator's figures (``Aggregator.stats``): what each one counts, and where it starts.

They go to pMaster with every heartbeat (and so into its status and the benchmarks' records).
The aggregator and its collaborators add to them on the serving thread; what helper threads
measure is handed back to it first (``reserve.MemoryReadier``).
"""
from __future__ import annotations

from dlrt.cpus import usable_cpus

__all__ = ["TIMED", "initial"]

# serving-thread work timed in the figures (``reserve.timed``)
TIMED = ("state_snapshot", "state_install", "state_takeover", "replica_install")


def initial(reserve: int) -> dict:
    """Every figure at its start; ``reserve``: the bytes of memory the aggregator was asked to
    make ready when it starts (``MemoryReadier.keep_reserve``)."""
    return {"cpus": usable_cpus(),     # what this process can use (affinity, cgroup quota)
            "pushes": 0, "pulls": 0, "errors": 0, "bytes_in": 0, "bytes_out": 0, "warm_bytes": 0,
            "late": 0, "postponed": 0, "migrated_in": 0, "migrated_out": 0,
            # hand-overs sent as the old owner (TENSOR_COPY messages with keys) and
            # the loop's CPU seconds sending them and taking their answers
            "handover_messages": 0, "handover_cpu_s": 0.0,
            "states_sent_ahead": 0, "taken_over_ahead": 0, "auth_refusals": 0, "ctrl_refusals": 0,
            # declarations, moves, replicas and failovers refused for want of room or past
            # --max-job-bytes / --max-tenant-bytes (``Commitments.check_room``)
            "memory_refusals": 0,
            # memory made ready for keys migrating in: bytes populated, heap warmed, the
            # CPU seconds it took (of which on CPU the host had to spare), the pauses
            # that kept the rest to --prefault-share, and the waits for a busy host
            "prefaulted_bytes": 0, "heap_warmed_bytes": 0, "prefault_cpu_s": 0.0,
            "prefault_idle_cpu_s": 0.0, "prefault_paused_s": 0.0, "prefault_waited_s": 0.0,
            # the same for keys a job waits for (its new keys, on the owner and the
            # replica; a new replica after a failure), made ready at once
            "at_once_prefaulted_bytes": 0, "at_once_prefault_cpu_s": 0.0,
            # and the helper threads' minor page faults doing either (a populated
            # page faults once; memory that was populated before, none)
            "prefault_faults": 0, "at_once_prefault_faults": 0,
            # the reserve: memory made ready (at start, and shared segments again as
            # jobs take them) for what arrives later, and its CPU
            "reserve_bytes": int(reserve), "reserve_warmed_bytes": 0, "reserve_cpu_s": 0.0,
            # server-mode state on the serving thread (seconds, the longest in ms, minor
            # page faults): the old owner's snapshots sent ahead of a switch, their
            # installs on a follower, the new owner's take-overs of the state that
            # came ahead, and whole states installed as a replica
            **{f"{name}_{unit}": 0 for name in TIMED for unit in ("s", "max_ms", "faults")}}
