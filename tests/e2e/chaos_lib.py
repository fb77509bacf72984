"""The pieces of the chaos test (``test_chaos.py``): three workloads that can be hurt and
checked, the faults' record, a watchdog, and what "nothing left behind" means.

* :class:`AutoPSJobs` -- one ``sum`` and one ``server`` job (W=2, in-process agents) training
  round after round on one pool (``test_failover.train``), every round compared with a
  failure-free reference round (``autops_testlib.check_same``);
* :class:`PagedDevice` -- daemon processes, a device, its FUSE file and a loop device, and a
  thread paging through the loop device (``O_DIRECT``) that checks every page it reads
  against its own model (``infiniswap_testlib.PageChurn``);
* :class:`TiresiasJobs` -- a live ``tiresias master`` (local executor) running counter jobs
  (``tiresias_jobs/counter.py``), one of them in a memory cgroup;
* :class:`FaultLog` -- every fault injected, and how the runtime survived it (the summary);
* :class:`Watchdog` -- fails the test (an exception in the main thread) past its budget;
* :func:`kernel_objects` / :class:`Census` -- the test's FUSE mounts, loop devices, swap
  areas, cgroups, front-end state files and processes, seen during the test and left after.

Every process these start carries ``$DLRT_CHAOS_TAG`` in its environment (inherited from
the test), so a process that outlives its owner is found by the tag, not by name.
"""
from __future__ import annotations

import json
import mmap
import os
import pathlib
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

INTEGRATION = pathlib.Path(__file__).resolve().parents[1] / "integration"
sys.path.insert(0, str(INTEGRATION))

from autops.worker.agent import AutoPSError  # noqa: E402
from infiniswap_testlib import PageChurn  # noqa: E402
from autops_testlib import check_same  # noqa: E402
from test_failover import ITERS, settled, train  # noqa: E402
from tiresias_live import MasterProcess, counter, steps  # noqa: E402

TAG_ENV = "DLRT_CHAOS_TAG"
MiB = 1 << 20
PAGE = 4096


# ---- the record of faults --------------------------------------------------------------------

@dataclass
class Fault:
    what: str                    # "aggregator", "infiniswap daemon", "tiresias run", "tiresias master"
    at: float                    # seconds since the chaos started
    detail: str = ""
    survived: str = ""           # how the runtime got over it (empty: not (yet) shown)


@dataclass
class FaultLog:
    t0: float = field(default_factory=time.monotonic)
    faults: list[Fault] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def injected(self, what: str, detail: str) -> Fault:
        fault = Fault(what, self.now(), detail)
        self.faults.append(fault)
        print(f"  [{fault.at:6.2f} s] SIGKILL {what}: {detail}", flush=True)
        return fault

    def note(self, text: str) -> None:
        print(f"  [{self.now():6.2f} s] {text}", flush=True)

    def summary(self) -> str:
        survived = [f for f in self.faults if f.survived]
        parts = [f"{f.what} at {f.at:.1f} s ({f.detail}; {f.survived or 'NOT SURVIVED'})"
                 for f in self.faults]
        return (f"{len(self.faults)} SIGKILLs injected, {len(survived)} survived: " + "; ".join(parts))


# ---- the watchdog ------------------------------------------------------------------------------

class Overrun(AssertionError):
    """The chaos test ran past its budget (raised in the main thread by the watchdog)."""


class Watchdog:
    """``with Watchdog(budget, describe):`` -- past ``budget`` seconds a thread interrupts the
    main thread (SIGUSR1 to it; the handler raises :class:`Overrun` with ``describe()``), so
    the test fails and its clean-up runs instead of hanging."""

    def __init__(self, budget: float, describe: Callable[[], str]) -> None:
        self.budget, self.describe = budget, describe
        self.fired = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="chaos-watchdog", daemon=True)
        self._main = threading.main_thread().ident
        self._previous: Any = None

    def _raise(self, signum: int, frame: Any) -> None:
        raise Overrun(f"the chaos test ran over its {self.budget:g} s budget: {self.describe()}")

    def _watch(self) -> None:
        if not self._done.wait(self.budget):
            self.fired = True
            signal.pthread_kill(self._main, signal.SIGUSR1)

    def __enter__(self) -> "Watchdog":
        assert threading.current_thread() is threading.main_thread()
        self._previous = signal.signal(signal.SIGUSR1, self._raise)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(5)
        signal.signal(signal.SIGUSR1, self._previous)


# ---- AutoPS: two jobs training round after round -------------------------------------------------

@dataclass
class Round:
    mode: str
    started: float
    ended: float
    error: str              # empty: bit-identical to the reference round


class AutoPSJobs:
    """A ``sum`` job and a ``server`` job training on ``pool`` in two threads, round after
    round (a round: a fresh W=2 job of ``ITERS`` iterations), each round checked against a
    failure-free reference round of its mode.  ``at[mode]``: the iteration the job is at
    (None between rounds)."""

    MODES = ("sum", "server")

    def __init__(self, pool: Any, gap: float = 0.1) -> None:
        self.pool, self.gap = pool, gap
        self.refs: dict[str, dict] = {}
        self.rounds: list[Round] = []
        self.refused = 0                 # rounds refused admission (and retried)
        self.at: dict[str, int | None] = {m: None for m in self.MODES}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(m,), name=f"autops-{m}", daemon=True)
                         for m in self.MODES]

    def train_references(self) -> None:
        """One failure-free round per mode: what every later round must equal."""
        self.refs = {mode: train(self.pool, mode, {}) for mode in self.MODES}

    def start(self) -> "AutoPSJobs":
        for t in self._threads:
            t.start()
        return self

    def _loop(self, mode: str) -> None:
        def hook(it: int, *job: str) -> None:
            self.at[mode] = it

        while not self._stop.is_set():
            started = time.monotonic()
            self.at[mode] = 0
            error = ""
            try:
                check_same(train(self.pool, mode, {}, iteration_hook=hook), self.refs[mode])
            except AutoPSError as exc:
                if "admission refused" not in str(exc):
                    error = f"AutoPSError: {str(exc)[:400]}"
                else:           # the other job's aggregators are not all free yet: as told, retry
                    self.at[mode] = None
                    self.refused += 1
                    self._stop.wait(self.gap)
                    continue
            except Exception as exc:  # noqa: BLE001 - recorded, reported by the test
                error = f"{type(exc).__name__}: {str(exc)[:400]}"
            self.at[mode] = None
            self.rounds.append(Round(mode, started, time.monotonic(), error))
            if error:
                return
            self._stop.wait(self.gap)

    def mid_round(self) -> bool:
        """Both jobs inside a round, with iterations done and iterations to come."""
        at = dict(self.at)
        return all(it is not None and 2 <= it <= ITERS - 2 for it in at.values())

    def errors(self) -> list[str]:
        return [f"{r.mode} round at {r.started:.1f}: {r.error}" for r in self.rounds if r.error]

    def passed_since(self, t: float) -> dict[str, int]:
        """Rounds per mode that started at or after ``t`` and equal the reference."""
        return {m: sum(1 for r in self.rounds if r.mode == m and r.started >= t and not r.error)
                for m in self.MODES}

    def hit_by(self, t: float) -> list[Round]:
        """Rounds in flight at ``t``."""
        return [r for r in self.rounds if r.started <= t <= r.ended]

    def kill_aggregator(self, name: str) -> None:
        self.pool.kill_aggregator(name)

    def settle(self, timeout: float) -> None:
        settled(self.pool, timeout)

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.1, deadline - time.monotonic()))


# ---- Infiniswap: a device paged through its loop device --------------------------------------------

class BlockFile:
    """Page-aligned reads and writes on a block device opened with ``O_DIRECT`` (no page
    cache: every request goes to the device), through one aligned buffer."""

    def __init__(self, path: str, max_bytes: int) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        self.buf = mmap.mmap(-1, max_bytes)

    def write(self, offset: int, data: bytes) -> None:
        n = len(data)
        self.buf[:n] = data
        with memoryview(self.buf) as view:
            done = os.pwritev(self.fd, [view[:n]], offset)
        if done != n:
            raise OSError(f"short write: {done} of {n} bytes at {offset}")

    def read(self, offset: int, length: int) -> bytes:
        with memoryview(self.buf) as view:
            done = os.preadv(self.fd, [view[:length]], offset)
        if done != length:
            raise OSError(f"short read: {done} of {length} bytes at {offset}")
        return self.buf[:length]

    def read_all(self, size: int, chunk: int) -> bytes:
        return b"".join(self.read(off, min(chunk, size - off)) for off in range(0, size, chunk))

    def close(self) -> None:
        os.close(self.fd)
        self.buf.close()


class PagedDevice:
    """``daemons`` daemon processes lending ``daemon_slabs`` slabs each, a device of ``slabs``
    1-MiB slabs (backup file in ``workdir``), its FUSE file and loop device, and a
    :class:`PageChurn` through the loop device.  With fewer free slabs on the survivors than
    the dead daemon held, the device can map everything again only on the restarted daemon."""

    CHUNK = 16 * PAGE                 # PageChurn's largest request

    def __init__(self, workdir: pathlib.Path, transport: str, seed: int, slabs: int = 8,
                 daemons: int = 3, daemon_slabs: int = 3) -> None:
        self.workdir, self.transport, self.seed = workdir, transport, seed
        self.size = slabs * MiB
        self.n_daemons, self.daemon_slabs = daemons, daemon_slabs
        self.mount = str(workdir / "mnt")
        self.daemons: Any = None
        self.device: Any = None
        self.frontend: Any = None
        self.block: BlockFile | None = None
        self.churn: PageChurn | None = None

    def start(self) -> "PagedDevice":
        from infiniswap import Device
        from infiniswap.frontend import Frontend
        from infiniswap.local import LocalDaemons
        self.daemons = LocalDaemons(self.n_daemons, slab_size=MiB, capacity=self.daemon_slabs * MiB,
                                    headroom=0, period=0.05, timeout=2.0).start()
        self.device = Device(self.size, backup=self.workdir / "backup", daemons=self.daemons.addresses,
                             slab_size=MiB, period=0.05, timeout=0.5, transport=self.transport)
        self.frontend = Frontend(self.device, self.mount, loop=True,
                                 fsname=f"infiniswap-chaos-{os.getpid()}").start()
        self.block = BlockFile(self.frontend.loop_device, self.CHUNK)
        self.churn = PageChurn(self.block, self.size // PAGE, seed=self.seed).start()
        return self

    def stats(self) -> dict[str, Any]:
        return self.device.stats()

    def all_mapped(self) -> bool:
        return self.stats()["slabs_mapped"] == self.size // MiB

    def holders(self) -> dict[Any, list[int]]:
        """Daemon process -> the slabs of this device it holds."""
        mapped = self.stats()["mapped"]
        return {d: mapped[d.address] for d in self.daemons.daemons if mapped.get(d.address)}

    def stop(self) -> None:
        """Stop paging, then take everything down in reverse order (each step also after a
        failed one)."""
        from infiniswap.frontend import cleanup
        try:
            if self.churn is not None:
                self.churn.stop()
            if self.block is not None:
                self.block.close()
                self.block = None
        finally:
            try:
                if self.frontend is not None:
                    self.frontend.stop()
                    self.frontend = None
            finally:
                cleanup(self.mount)           # whatever a failed stop left of the mount
                try:
                    if self.device is not None:
                        self.device.close()
                        self.device = None
                finally:
                    if self.daemons is not None:
                        self.daemons.stop()
                        self.daemons = None

    def verify_after_paging(self) -> list[str]:
        """With the churn stopped: every page, read through the loop device and through the
        device, equals the model (flushed to the backup file too)."""
        assert self.churn is not None and self.block is not None
        self.churn.stop()
        problems = list(self.churn.errors)
        model = bytes(self.churn.model)
        if self.block.read_all(self.size, self.CHUNK) != model:
            problems.append("the loop device does not read back what was written")
        if self.device.read(0, self.size) != model:
            problems.append("the device does not read back what was written")
        self.device.flush()
        if (self.workdir / "backup").read_bytes() != model:
            problems.append("the backup file does not hold what was written")
        return problems


# ---- Tiresias: a live master running counter jobs ----------------------------------------------------

@dataclass
class TiresiasJob:
    name: str
    gpus: int
    steps: int
    memory: int | None = None
    job_id: int = 0
    killed_runs: int = 0


class TiresiasJobs:
    """A live master on two emulated nodes of two GPUs and three counter jobs: ``steady``
    and ``limited`` (in a memory cgroup) start at once, ``queued`` waits for ``limited``'s
    GPUs and then runs long enough that some job without a cgroup runs all through the
    chaos window (one of them is the run to kill)."""

    def __init__(self, state: pathlib.Path, jobs: list[TiresiasJob] | None = None, pause: float = 0.1) -> None:
        self.state, self.pause = state, pause
        self.master = MasterProcess(state, "--nodes", "2x2", "--interval", "0.5", "--stop-grace", "2")
        self.jobs = jobs if jobs is not None else [
            TiresiasJob("steady", 2, 120), TiresiasJob("limited", 1, 60, memory=256 * MiB),
            TiresiasJob("queued", 2, 150)]

    def start(self) -> "TiresiasJobs":
        self.master.start()
        for job in self.jobs:
            extra = {"memory": job.memory} if job.memory else {}
            job.job_id = self.master.submit(job.gpus, *counter(job.steps, self.pause), name=job.name, **extra)
        return self

    @property
    def master_up(self) -> bool:
        return self.master.proc is not None and self.master.proc.poll() is None

    def running(self) -> list[TiresiasJob]:
        """Jobs with a live run, from the state dir (works while the master is down)."""
        return [job for job in self.jobs if self.supervisor(job) is not None]

    def supervisor(self, job: TiresiasJob) -> int | None:
        """The pid of the live supervisor of ``job``'s latest run, or None."""
        runs = sorted(self.state.glob(f"jobs/{job.job_id}/run*"), key=lambda p: int(p.name[3:]))
        if not runs or (runs[-1] / "exit.json").exists():
            return None
        try:
            pid = int((runs[-1] / "supervisor.pid").read_text())
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                alive = b"tiresias.service.supervisor" in f.read()
            with open(f"/proc/{pid}/stat") as f:
                alive = alive and f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, ValueError):
            return None
        return pid if alive else None

    def steps_left(self, job: TiresiasJob) -> int:
        done = steps(self.state, job.job_id)
        return job.steps - (done[-1] if done else 0)

    def kill_run(self, job: TiresiasJob) -> int:
        """SIGKILL the whole run (supervisor and job processes, as a crash of its node
        would), the supervisor first: it must not live to record its job's death as an exit
        status.  Returns how many processes were killed."""
        import psutil
        pid = self.supervisor(job)
        if pid is None:
            return 0
        try:
            supervisor = psutil.Process(pid)
            procs = [supervisor] + supervisor.children(recursive=True)
        except psutil.NoSuchProcess:        # the run just ended
            return 0
        job.killed_runs += 1
        for proc in procs:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        return len(procs)

    def kill_master(self) -> None:
        self.master.kill(signal.SIGKILL)

    def restart_master(self) -> None:
        self.master.start()

    def all_ended(self) -> bool:
        return self.master_up and all(self.master.job(j.job_id)["status"] in ("finished", "failed", "cancelled")
                                      for j in self.jobs)

    def events(self, job: TiresiasJob) -> list[str]:
        return [e["kind"] for e in self.master.client.get(f"/api/v1/events?job={job.job_id}&limit=500")]

    def verify(self) -> list[str]:
        """Every job finished exactly once (:meth:`finished_once`), none lost or added, and
        each killed run was noticed as lost and resumed (a killed run has no checkpoint
        here: it starts again at step 1)."""
        problems = []
        stored = {j["id"] for j in self.master.client.get("/api/v1/jobs")}
        wanted = {j.job_id for j in self.jobs}
        if stored != wanted:
            problems.append(f"jobs stored {sorted(stored)}, submitted {sorted(wanted)}")
        for job in self.jobs:
            problems += self.finished_once(job)
            view, kinds = self.master.job(job.job_id), self.events(job)
            where = f"tiresias job {job.job_id} ({job.name})"
            if (kinds.count("started") != 1 or kinds.count("lost") != job.killed_runs
                    or kinds.count("resumed") != job.killed_runs or view["run"] != 1 + job.killed_runs):
                problems.append(f"{where}: {job.killed_runs} run(s) killed, run {view['run']}, events {kinds}")
            segments = _segments(steps(self.state, job.job_id))
            if len(segments) != 1 + job.killed_runs or any(s[0] != 1 for s in segments):
                problems.append(f"{where}: steps by run {[(s[0], s[-1]) for s in segments]}")
        return problems

    def finished_once(self, job: TiresiasJob) -> list[str]:
        """``job`` finished (exit 0), once: one 'finished' event, one 'done' in its log, its
        last run counted to the end, and never two copies running at once (``DOUBLE``)."""
        problems = []
        view, kinds = self.master.job(job.job_id), self.events(job)
        where = f"tiresias job {job.job_id} ({job.name})"
        if view["status"] != "finished" or view["exit_code"] != 0:
            problems.append(f"{where} is {view['status']} (exit {view['exit_code']}): {view['detail'][:300]}")
        if kinds.count("finished") != 1:
            problems.append(f"{where}: events {kinds}")
        ckpt = self.state / "checkpoints" / str(job.job_id) / "checkpoint"
        if (ckpt / "DOUBLE").exists():
            problems.append(f"{where} ran twice at once: {(ckpt / 'DOUBLE').read_text().strip()}")
        log = (self.state / "jobs" / str(job.job_id) / "job.log").read_text()
        if log.count(f"done at step {job.steps}\n") != 1:
            problems.append(f"{where}: 'done at step {job.steps}' {log.count('done at step')} times in its log")
        segments = _segments(steps(self.state, job.job_id))
        if not segments or segments[-1][-1] != job.steps:
            problems.append(f"{where}: steps by run {[(s[0], s[-1]) for s in segments]}")
        return problems

    def stop(self) -> None:
        self.master.stop()               # and every process of every run it started


def _segments(counted: list[int]) -> list[list[int]]:
    """Split a step log into runs of consecutive steps."""
    out: list[list[int]] = []
    for s in counted:
        if out and s == out[-1][-1] + 1:
            out[-1].append(s)
        else:
            out.append([s])
    return out


# ---- nothing left behind -------------------------------------------------------------------------------
# What the test made is told apart from what other programs on the machine make at the same
# time: kernel objects on files under the test's own directory (``scope``), cgroups that held
# one of its processes, processes that carry its tag.

def tagged_processes(tag: str) -> dict[int, str]:
    """pid -> command line of every live process (not this one) whose environment carries
    ``DLRT_CHAOS_TAG=tag``."""
    marker = f"\0{TAG_ENV}={tag}\0".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker not in b"\0" + f.read() + b"\0":
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
    return found


def _loop_devices() -> dict[str, str]:
    """/dev/loopN -> its backing file, for every attached loop device."""
    loops = {}
    for name in os.listdir("/sys/block"):
        try:
            with open(f"/sys/block/{name}/loop/backing_file", encoding="utf-8") as fh:
                loops[f"/dev/{name}"] = fh.read().strip()
        except OSError:
            continue
    return loops


def _memory_cgroups() -> list[str]:
    """The cgroups under the Infiniswap and Tiresias parents on the memory hierarchy."""
    from infiniswap import cgroup as isw_cgroup
    from tiresias.service import cgroup as trs_cgroup
    _, root = isw_cgroup.find_hierarchy()
    groups = []
    for parent in (isw_cgroup.PARENT, trs_cgroup.PARENT):
        base = os.path.join(root, parent)
        if os.path.isdir(base):
            groups += [os.path.join(base, g) for g in os.listdir(base) if os.path.isdir(os.path.join(base, g))]
    return groups


def _cgroup_pids(path: str) -> set[int]:
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return {int(p) for p in f.read().split()}
    except OSError:
        return set()


def kernel_objects(tag: str, scope: pathlib.Path) -> dict[str, set[str]]:
    """This test's FUSE mounts and loop devices (on files under ``scope``), swap areas on
    those, front-end state files of mounts under ``scope``, memory cgroups holding one of
    its processes, and its processes (carrying ``tag``)."""
    from infiniswap.frontend import state_dir
    prefix = str(scope.resolve()) + os.sep
    with open("/proc/mounts", encoding="utf-8") as fh:
        fuse = {f"{p[0]} on {p[1]}" for p in (line.split() for line in fh)
                if p[2].startswith("fuse") and p[1].startswith(prefix)}
    loops = {dev: f for dev, f in _loop_devices().items() if f.startswith(prefix)}
    with open("/proc/swaps", encoding="utf-8") as fh:
        swaps = {p[0] for p in (line.split() for line in fh.readlines()[1:] if line.strip())
                 if p[0] in loops or p[0].startswith(prefix)}
    states = set()
    if os.path.isdir(state_dir()):
        for name in os.listdir(state_dir()):
            try:
                with open(os.path.join(state_dir(), name), encoding="utf-8") as fh:
                    if str(json.load(fh).get("mount", "")).startswith(prefix):
                        states.add(name)
            except (OSError, ValueError, AttributeError):
                continue
    procs = tagged_processes(tag)
    groups = {g for g in _memory_cgroups() if _cgroup_pids(g) & set(procs)}
    return {"fuse mounts": fuse, "loop devices": {f"{d} on {f}" for d, f in loops.items()},
            "swap areas": swaps, "front-end state files": states, "cgroups": groups,
            "processes": {f"{pid} {cmd[:160]}" for pid, cmd in procs.items()}}


class Census(threading.Thread):
    """Every ``period`` s, adds to ``seen`` what :func:`kernel_objects` finds: what the
    clean-up check has to find gone (and proof that it had something to check)."""

    def __init__(self, tag: str, scope: pathlib.Path, period: float = 0.3) -> None:
        super().__init__(name="chaos-census", daemon=True)
        self.tag, self.scope, self.period = tag, scope, period
        self.seen: dict[str, set[str]] = {}
        self._halt = threading.Event()

    def _count(self) -> None:
        for kind, found in kernel_objects(self.tag, self.scope).items():
            self.seen.setdefault(kind, set()).update(found)

    def run(self) -> None:
        while not self._halt.wait(self.period):
            self._count()

    def stop(self) -> dict[str, int]:
        """Stop counting; how many of each kind were seen."""
        self._halt.set()
        self.join(10)
        return {kind: len(found) for kind, found in self.seen.items()}

    def left_behind(self) -> dict[str, set[str]]:
        """What is still there (by kind; empty kinds omitted), including every cgroup that
        once held a process of the test, now empty or not."""
        now = kernel_objects(self.tag, self.scope)
        now["cgroups"] |= {g for g in self.seen.get("cgroups", ()) if os.path.isdir(g)}
        return {kind: found for kind, found in now.items() if found}


def remove_cgroups(paths: set[str], tag: str, timeout: float = 5.0) -> None:
    """Remove each cgroup that holds no process or only processes carrying ``tag`` (killed
    first); a cgroup with anybody else's process in it is left alone."""
    for path in paths:
        deadline = time.monotonic() + timeout
        while os.path.isdir(path):
            try:
                inside = _cgroup_pids(path)
                if inside - set(tagged_processes(tag)):
                    break
                kill_pids(list(inside))
                os.rmdir(path)
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)


def wait_gone(tag: str, timeout: float) -> dict[int, str]:
    """Wait up to ``timeout`` s for the tagged processes to exit; returns those still there."""
    deadline = time.monotonic() + timeout
    while True:
        alive = tagged_processes(tag)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def kill_pids(pids: list[int]) -> None:
    """SIGKILL the given pids (processes this test started, found by its tag)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
