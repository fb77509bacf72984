"""The Infiniswap front end: the device as a FUSE file, a loop device (direct I/O) and swap.

* ``FuseServer``: the file's bytes are the device's, at any offset and length (aligned,
  unaligned, across slab boundaries, from concurrent threads); fixed size; stop works
  while a loop device still holds the file and has requests in flight;
* ``Frontend``: loop device round trip with direct I/O; swap on a 64 MiB device listed in
  /proc/swaps, gone after ``stop()``; reverse-order teardown;
* ``infiniswap device --mount DIR --loop --swap`` as a child process: SIGTERM -> exit 0
  and nothing left (mounts, loop devices, swap); SIGKILL then ``infiniswap device stop
  --mount DIR`` -> nothing left; the device keeps serving from its backup file when its
  daemon dies;
* ``harden_process`` reports what it could do.

Root-only: without root, /dev/fuse, losetup or swap support these tests skip with the
reason.  Every fixture undoes what it created (swapoff, losetup -d, unmount) in
``finally``, also when a test fails.  Swap areas are system-wide: while one of these
tests has swap on, any process on the machine under memory pressure may page into it —
so they use small devices at the kernel's default (lowest) priority and keep the window
short.
"""
from __future__ import annotations

import errno
import json
import mmap
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
PAGE = 4096
CLI = [sys.executable, "-m", "infiniswap.cli"]


def _missing() -> str | None:
    if sys.platform != "linux":
        return "Linux only"
    if os.geteuid() != 0:
        return "needs root (FUSE mount options, losetup, swapon)"
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing (no fuse kernel module)"
    for tool in ("losetup", "mkswap", "swapon", "swapoff"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (util-linux)"
    if not os.path.exists("/proc/swaps"):
        return "the kernel has no swap support (/proc/swaps missing)"
    try:
        from infiniswap.core import FuseServer  # noqa: F401
    except ImportError as exc:
        return f"the C core has no FUSE front end: {exc}"
    return None


@pytest.fixture(scope="module", autouse=True)
def _require_root_fuse():
    reason = _missing()
    if reason:
        print(f"\nSKIPPED infiniswap front-end tests: {reason}")
        pytest.skip(reason)


# ---- what the kernel has: mounts, loop devices, swap ----

def mounted(path: str) -> bool:
    with open("/proc/self/mounts", encoding="utf-8") as fh:
        return any(line.split()[1] == path for line in fh)


def loops_backed_by(prefix: str) -> list[str]:
    found = []
    for name in os.listdir("/sys/block"):
        try:
            with open(f"/sys/block/{name}/loop/backing_file", encoding="utf-8") as fh:
                if fh.read().strip().startswith(prefix):
                    found.append(f"/dev/{name}")
        except OSError:
            continue
    return found


def swaps() -> list[str]:
    with open("/proc/swaps", encoding="utf-8") as fh:
        return [line.split()[0] for line in fh.readlines()[1:]]


def assert_nothing_left(mount: str) -> None:
    from infiniswap import frontend
    assert not mounted(mount), f"{mount} is still mounted"
    assert loops_backed_by(mount) == [], "a loop device is still attached"
    assert frontend.remains(mount) == []
    assert not os.path.exists(frontend.state_path(mount)), "the state file is still there"


@pytest.fixture
def undo():
    """Mount directories a test uses: whatever is left of them afterwards — swap, loop
    devices, FUSE mounts, state files — is taken down, also when the test failed."""
    mounts: list[str] = []
    yield mounts.append
    from infiniswap import frontend
    for m in mounts:
        for lo in loops_backed_by(m):
            if lo in swaps():
                subprocess.run(["swapoff", lo], check=False)
        try:
            frontend.cleanup(m)
        finally:
            for lo in loops_backed_by(m):
                subprocess.run(["losetup", "-d", lo], check=False)
            if mounted(m):
                subprocess.run(["umount", "-l", m], check=False)


@pytest.fixture
def core(tmp_path):
    from infiniswap.core import CoreDevice
    devs = []

    def make(size: int = 16 * MiB, slab: int = MiB):
        d = CoreDevice(size, slab, tmp_path / f"backup{len(devs)}")
        devs.append(d)
        return d
    try:
        yield make
    finally:
        for d in devs:
            d.close()


@pytest.fixture
def served(core, tmp_path, undo):
    """A FuseServer over a 16 MiB device (1 MiB slabs); stopped afterwards."""
    from infiniswap.core import FuseServer
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    undo(str(mnt))
    dev = core()
    srv = FuseServer(dev, mnt)
    try:
        yield dev, srv
    finally:
        srv.stop()


def aligned(n: int) -> mmap.mmap:
    return mmap.mmap(-1, n)        # page-aligned, as O_DIRECT wants


# ---- the FUSE file ----

def test_fuse_file_is_the_device(served):
    dev, srv = served
    size = dev.size
    assert os.listdir(srv.mountpoint) == ["disk"]
    st = os.stat(srv.path)
    assert st.st_size == size and (st.st_mode & 0o777) == 0o600
    model = bytearray(size)
    rng = random.Random(7)
    fd = os.open(srv.path, os.O_RDWR)
    try:
        cases = [(0, PAGE), (PAGE, 8 * PAGE), (4095, 2), (1, 1), (MiB - 100, 300),
                 (3 * MiB - 5000, 2 * MiB + 10001), (size - 10, 10), (5 * MiB + 17, MiB),
                 (7 * MiB, 3 * MiB)]
        for off, n in cases:
            data = rng.randbytes(n)
            assert os.pwrite(fd, data, off) == n
            model[off:off + n] = data
        assert dev.read(0, size) == bytes(model)          # the device has what we wrote
        for off, n in cases + [(123, 4567), (MiB - 1, 2), (0, size)]:
            got = b"".join(os.pread(fd, min(MiB, n - k), off + k) for k in range(0, n, MiB))
            assert got == bytes(model[off:off + n]), (off, n)
        dev.write(2 * MiB, b"\xab" * PAGE)                  # and the file has the device's
        assert os.pread(fd, PAGE + 2, 2 * MiB - 1) == bytes(model[2 * MiB - 1:2 * MiB]) + \
            b"\xab" * PAGE + bytes(model[2 * MiB + PAGE:2 * MiB + PAGE + 1])
        assert os.pread(fd, 100, size) == b""               # end of file
        assert os.pread(fd, 100, size - 4) == bytes(model[-4:])
        os.fsync(fd)
    finally:
        os.close(fd)
    stats = srv.stats()
    assert stats.unaligned > 0 and stats.errors == 0 and stats.flushes >= 1
    assert stats.bytes_written == sum(n for _, n in cases)


def test_fuse_file_has_a_fixed_size(served):
    dev, srv = served
    with pytest.raises(OSError) as e:
        os.truncate(srv.path, 0)
    assert e.value.errno == errno.EPERM
    with pytest.raises(OSError):
        open(srv.path, "wb").close()                        # O_TRUNC
    with pytest.raises(OSError):
        open(os.path.join(srv.mountpoint, "other"), "w").close()
    fd = os.open(srv.path, os.O_WRONLY)
    try:
        with pytest.raises(OSError) as e:
            os.pwrite(fd, b"x" * 10, dev.size)
        assert e.value.errno == errno.ENOSPC
        assert os.pwrite(fd, b"y" * 10, dev.size - 4) == 4  # short write up to the end
    finally:
        os.close(fd)
    os.truncate(srv.path, dev.size)                         # same size: allowed
    assert os.stat(srv.path).st_size == dev.size
    assert dev.read(dev.size - PAGE, PAGE)[-4:] == b"yyyy"
    assert "past the end" in srv.last_io_error()


def test_fuse_file_concurrent_threads(served):
    """Threads writing different bytes of the same pages (read-modify-write) and whole
    pages elsewhere, with readers running: nothing is lost."""
    dev, srv = served
    nthreads, pages, chunk = 4, 64, 1000
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        try:
            fd = os.open(srv.path, os.O_RDWR)
            try:
                for p in range(pages):              # unaligned pieces of shared pages
                    os.pwrite(fd, bytes([i + 1]) * chunk, p * PAGE + i * chunk)
                base = 8 * MiB + i * MiB            # and whole pages of its own
                os.pwrite(fd, bytes([0x40 + i]) * (256 * 1024), base)
            finally:
                os.close(fd)
        except BaseException as exc:                # noqa: BLE001 - reported below
            errors.append(exc)

    def reader() -> None:
        try:
            fd = os.open(srv.path, os.O_RDONLY)
            try:
                for k in range(200):
                    assert len(os.pread(fd, 3 * PAGE + 5, (k * 7919) % (4 * MiB))) == 3 * PAGE + 5
            finally:
                os.close(fd)
        except BaseException as exc:                # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(nthreads)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    data = dev.read(0, pages * PAGE)
    for p in range(pages):
        for i in range(nthreads):
            piece = data[p * PAGE + i * chunk:p * PAGE + (i + 1) * chunk]
            assert piece == bytes([i + 1]) * chunk, (p, i)
    for i in range(nthreads):
        assert dev.read(8 * MiB + i * MiB, 256 * 1024) == bytes([0x40 + i]) * (256 * 1024)


def test_fuse_stop_while_a_loop_device_has_requests_in_flight(core, tmp_path, undo):
    """stop() with the loop device still attached and reading: it returns (the FUSE
    connection is aborted after a grace period), the reads fail instead of hanging."""
    from infiniswap.core import FuseServer
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    undo(str(mnt))
    srv = FuseServer(core(), mnt)
    loop = subprocess.run(["losetup", "--find", "--show", "--direct-io=on", srv.path],
                          check=True, capture_output=True, text=True).stdout.strip()
    outcome: dict[str, object] = {}

    def read_forever() -> None:
        fd = os.open(loop, os.O_RDONLY | os.O_DIRECT)
        buf = aligned(64 * 1024)
        try:
            while True:
                os.preadv(fd, [buf], random.randrange(0, 16 * MiB, 64 * 1024))
        except OSError as exc:
            outcome["error"] = exc.errno
        finally:
            os.close(fd)
    try:
        t = threading.Thread(target=read_forever, daemon=True)
        t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        srv.stop()
        assert time.monotonic() - t0 < 20
        assert not mounted(str(mnt))
        t.join(20)
        assert not t.is_alive() and outcome.get("error") is not None
    finally:
        subprocess.run(["losetup", "-d", loop], check=False)


# ---- Frontend: loop device and swap ----

def test_loop_device_direct_io_round_trip(core, tmp_path, undo):
    from infiniswap.frontend import Frontend
    mnt = str(tmp_path / "mnt")
    undo(mnt)
    dev = core(32 * MiB)
    with Frontend(dev, mnt, loop=True) as fe:
        loop = fe.loop_device
        assert loop and loop.startswith("/dev/loop")
        name = os.path.basename(loop)
        with open(f"/sys/block/{name}/loop/dio") as fh:
            assert fh.read().strip() == "1"
        with open(f"/sys/block/{name}/loop/backing_file") as fh:
            assert fh.read().strip() == fe.disk_path
        state = json.load(open(fe.state_file))
        assert state["loop"] == loop and state["pid"] == os.getpid() and not state["swap"]

        rng = random.Random(3)
        pattern = rng.randbytes(3 * MiB)
        buf = aligned(len(pattern))
        buf[:] = pattern
        fd = os.open(loop, os.O_RDWR | os.O_DIRECT)
        try:
            assert os.pwritev(fd, [buf], MiB - 64 * 1024) == len(pattern)  # spans slabs
            back = aligned(len(pattern))
            assert os.preadv(fd, [back], MiB - 64 * 1024) == len(pattern)
            assert back[:] == pattern
        finally:
            os.close(fd)
        assert dev.read(MiB - 64 * 1024, len(pattern)) == pattern
        src = tmp_path / "pattern"
        src.write_bytes(pattern[:MiB])
        subprocess.run(["dd", f"if={src}", f"of={loop}", "bs=64k", "seek=320", "oflag=direct",
                        "conv=notrunc,fsync", "status=none"], check=True)
        assert dev.read(20 * MiB, MiB) == pattern[:MiB]
    assert_nothing_left(mnt)


def test_swap_on_a_small_device(core, tmp_path, undo):
    from infiniswap.frontend import Frontend
    mnt = str(tmp_path / "mnt")
    undo(mnt)
    fe = Frontend(core(64 * MiB), mnt, loop=True, swap=True)
    try:
        fe.start()
        assert fe.swap_on and fe.loop_device in swaps()
        with open("/proc/swaps") as fh:
            line = next(ln for ln in fh if ln.startswith(fe.loop_device))
        assert int(line.split()[2]) >= 60 * 1024             # KiB: the device's size
        state = json.load(open(fe.state_file))
        assert state["swap"] and state["loop"] == fe.loop_device
    finally:
        fe.stop()
    assert fe.loop_device is None and not fe.swap_on
    assert_nothing_left(mnt)
    fe.stop()                                                # idempotent


def test_swap_refuses_a_backup_file_on_tmpfs(tmp_path):
    """DESIGN.md §4's deadlock: a tmpfs backup file could be swapped into its own device."""
    from infiniswap.core import CoreDevice
    from infiniswap.frontend import Frontend, _fs_type
    if _fs_type("/dev/shm") != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs here")
    backup = f"/dev/shm/infiniswap-test-{os.getpid()}"
    dev = CoreDevice(4 * MiB, MiB, backup)
    try:
        with pytest.raises(ValueError, match="tmpfs"):
            Frontend(dev, tmp_path / "mnt", loop=True, swap=True)
        Frontend(dev, tmp_path / "mnt", loop=True)          # without swap: fine
    finally:
        dev.close()
        os.unlink(backup)


# ---- the command ----

def first_line(proc: subprocess.Popen, wait: float = 60) -> str:
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.1)[0]:
            return proc.stdout.readline()
        if proc.poll() is not None:
            break
    raise AssertionError("the device did not announce itself")


@pytest.fixture
def device_cli(tmp_path, undo):
    """Start ``infiniswap device ... --mount DIR``; always killed by pid afterwards (and
    what it left cleaned up by ``undo``)."""
    procs: list[subprocess.Popen] = []

    def start(*extra: str, size: str = "64M", daemons: list[str] | None = None):
        mnt = str(tmp_path / f"mnt{len(procs)}")
        undo(mnt)
        cmd = [*CLI, "device", "--size", size, "--slab-size", "1M", "--backup",
               str(tmp_path / f"backup{len(procs)}"), "--mount", mnt, "--period", "0.2",
               "--timeout", "1", *extra]
        if daemons:
            cmd += ["--daemons", ",".join(daemons)]
        log = open(tmp_path / f"device{len(procs)}.log", "wb")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        log.close()
        procs.append(proc)
        line = first_line(proc)
        m = re.search(r"loop (\S+) swap (on|off)", line)
        assert m, f"unexpected announcement: {line!r}"
        return proc, mnt, m.group(1), m.group(2) == "on"
    try:
        yield start
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
            proc.stdout.close()


def vmlck_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return int(next(ln for ln in fh if ln.startswith("VmLck")).split()[1])


def test_cli_device_swap_sigterm_leaves_nothing(device_cli):
    proc, mnt, loop, swap_on = device_cli("--swap")
    assert swap_on and loop in swaps() and mounted(mnt)
    assert loops_backed_by(mnt) == [loop]
    assert vmlck_kib(proc.pid) > 0                  # hardened: mlockall
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(60) == 0
    assert_nothing_left(mnt)
    assert not os.path.exists(mnt)                  # created by the device, removed again


def test_cli_device_sigkill_then_device_stop(device_cli):
    proc, mnt, loop, swap_on = device_cli("--loop", "--swap")
    assert swap_on and loop in swaps()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    assert loop in swaps() and mounted(mnt)         # left behind by the dead process
    out = subprocess.run([*CLI, "device", "stop", "--mount", mnt], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "cleaned up" in out.stdout
    assert_nothing_left(mnt)
    again = subprocess.run([*CLI, "device", "stop", "--mount", mnt], capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 0 and "nothing to stop" in again.stdout


def test_cli_device_keeps_serving_when_its_daemon_dies(device_cli):
    """A device mapped to a daemon, attached as a loop device: data written through the
    loop device reads back the same after the daemon is killed (the backup file), new
    writes work, and `infiniswap device stop` stops it cleanly."""
    from infiniswap.local import LocalDaemons
    with LocalDaemons(1, slab_size=MiB, capacity=32 * MiB, headroom=0, period=0.1) as daemons:
        proc, mnt, loop, swap_on = device_cli("--loop", "--map-all", size="16M",
                                              daemons=daemons.addresses)
        assert not swap_on and loop.startswith("/dev/loop")
        rng = random.Random(11)
        pattern = rng.randbytes(4 * MiB)
        buf, back = aligned(len(pattern)), aligned(len(pattern))
        buf[:] = pattern
        fd = os.open(loop, os.O_RDWR | os.O_DIRECT)
        try:
            os.pwritev(fd, [buf], 2 * MiB)
            daemons[0].kill()                           # SIGKILL: remote memory is gone
            os.preadv(fd, [back], 2 * MiB)
            assert back[:] == pattern
            buf[:PAGE] = b"\x5a" * PAGE
            os.pwritev(fd, [memoryview(buf)[:PAGE]], 9 * MiB)
            os.preadv(fd, [memoryview(back)[:PAGE]], 9 * MiB)
            assert back[:PAGE] == b"\x5a" * PAGE
        finally:
            os.close(fd)
        assert proc.poll() is None
        out = subprocess.run([*CLI, "device", "stop", "--mount", mnt], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert proc.wait(10) == 0
        assert_nothing_left(mnt)


def test_cli_front_end_argument_errors(tmp_path):
    out = subprocess.run([*CLI, "device", "--size", "4M", "--slab-size", "1M", "--backup",
                          str(tmp_path / "b"), "--swap"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 2 and "need --mount" in out.stderr
    assert "Traceback" not in out.stderr
    out = subprocess.run([*CLI, "device", "stop"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "--mount" in out.stderr
    out = subprocess.run([*CLI, "device", "stop", "--mount", str(tmp_path / "none")],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "nothing to stop" in out.stdout


# ---- hardening ----

def test_daemons_harden_themselves_as_root_unless_told_not_to():
    from infiniswap.local import LocalDaemons
    with LocalDaemons(1, slab_size=MiB, capacity=4 * MiB) as hardened, \
            LocalDaemons(1, slab_size=MiB, capacity=4 * MiB, extra=["--no-harden"]) as plain:
        assert vmlck_kib(hardened[0].pid) > 0
        assert vmlck_kib(plain[0].pid) == 0         # --no-lock and --no-harden: nothing

def test_harden_process_reports_what_it_did():
    code = ("import json, logging; logging.basicConfig(level=logging.INFO)\n"
            "from infiniswap.hardening import harden_process\n"
            "r = harden_process('probe')\n"
            "st = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
            "print(json.dumps({'mlocked': r.mlocked, 'io_flusher': r.io_flusher,\n"
            "  'oom': r.oom_protected, 'failures': r.failures,\n"
            "  'vmlck_kb': int(st['VmLck'].split()[0]),\n"
            "  'adj': open('/proc/self/oom_score_adj').read().strip()}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["mlocked"] and r["vmlck_kb"] > 0              # root has CAP_IPC_LOCK
    with open("/proc/self/status") as fh:
        cap_eff = int(next(ln for ln in fh if ln.startswith("CapEff")).split()[1], 16)
    has_sys_resource = bool(cap_eff & (1 << 24))
    assert r["io_flusher"] == has_sys_resource
    assert r["oom"] == has_sys_resource and (r["adj"] == "-1000") == has_sys_resource
    for step in ("io_flusher", "oom_score_adj"):
        assert (step in r["failures"]) != has_sys_resource
        if not has_sys_resource:
            assert "CAP_SYS_RESOURCE" in r["failures"][step]
            assert f"{step} failed" in out.stderr           # logged, not silent
