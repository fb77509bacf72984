"""The device as something unmodified programs and the kernel page into: FUSE file, loop
device, swap (DESIGN.md §4).

    with Frontend(dev.core, "/run/infiniswap/mnt", loop=True, swap=True, swap_priority=10) as fe:
        print(fe.disk_path, fe.loop_device)     # .../mnt/disk  /dev/loop3 — now swap
    # swapoff, losetup -d, unmount: undone in reverse order

Owns three layers, each on the one below it, and taking them down in reverse order:

1. a :class:`~infiniswap.core.FuseServer` serving ``MOUNT/disk`` from an open
   :class:`~infiniswap.core.CoreDevice` (C threads; direct I/O);
2. optionally a loop device on that file: ``losetup --find --show --direct-io=on
   --sector-size 4096`` (direct I/O: no page-cache copy; 4 KiB sectors: every request the
   loop device sends is page-aligned);
3. optionally swap on the loop device: ``mkswap`` + ``swapon [--priority N]``.

What is up is recorded in a small JSON state file under ``/run/infiniswap/`` (one per
mount directory: device pid, mount, FUSE device number, loop device, swap on/off), so
another process — ``infiniswap device stop --mount DIR`` — can undo it, also after the
device process died: :func:`cleanup` takes down whatever is left of a mount (swap on a
loop device backed by its ``disk``, the loop device, the dead FUSE mount) and never
touches a loop device or swap area that is not backed by that file.

Teardown never pulls a layer from under a live one: if ``swapoff`` fails (it needs
memory to read every swapped-out page back), :meth:`Frontend.stop` raises
:class:`SwapStillActive` and leaves the loop device and the FUSE server serving —
stopping them would lose the pages other processes have in this swap.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import time
from typing import Any

from infiniswap.core import CoreDevice, FuseServer

__all__ = ["Frontend", "SwapStillActive", "cleanup", "owner_alive", "read_state", "remains",
           "state_dir", "state_path"]

log = logging.getLogger("infiniswap.frontend")

DISK_NAME = "disk"
DISK_INO = 2            # the inode number the C server gives `disk`
_STATE_VERSION = 1
_CMD_TIMEOUT = 120.0    # swapoff reads every swapped-out page back


class SwapStillActive(OSError):
    """swapoff failed: the swap area (and everything below it) is still in use."""


# ---- state files ----

def state_dir() -> str:
    """Where state files live: ``$INFINISWAP_STATE_DIR``, else ``/run/infiniswap`` for
    root, else ``$XDG_RUNTIME_DIR/infiniswap`` (or ``/tmp/infiniswap-UID``)."""
    env = os.environ.get("INFINISWAP_STATE_DIR")
    if env:
        return env
    if os.geteuid() == 0:
        return "/run/infiniswap"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(runtime, "infiniswap") if runtime else f"/tmp/infiniswap-{os.getuid()}"


def _norm(mount: str | os.PathLike[str]) -> str:
    return os.path.abspath(os.fsdecode(mount))


def state_path(mount: str | os.PathLike[str], directory: str | None = None) -> str:
    """The state file of a mount directory (keyed by its absolute path)."""
    path = _norm(mount)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", path.strip("/"))[-60:] or "root"
    digest = hashlib.sha1(path.encode()).hexdigest()[:10]
    return os.path.join(directory or state_dir(), f"{slug}-{digest}.json")


def read_state(mount: str | os.PathLike[str], directory: str | None = None) -> dict | None:
    """The recorded state of a mount directory, or None (no file, or unreadable)."""
    try:
        with open(state_path(mount, directory), encoding="utf-8") as fh:
            state = json.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable state file %s: %s", state_path(mount, directory), exc)
        return None
    return state if isinstance(state, dict) else None


def _write_state(path: str, state: dict) -> None:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(state, fh, indent=1)
    os.replace(tmp, path)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# ---- what the kernel has ----

def _unescape(field: str) -> str:
    """/proc/mounts and /proc/swaps escape space, tab, newline and backslash as \\ooo."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mount_type(mount: str) -> str | None:
    """The file system type mounted at ``mount`` (the top one), or None."""
    found = None
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) >= 3 and _unescape(parts[1]) == mount:
                    found = parts[2]
    except OSError:
        pass
    return found


def _fs_type(path: str) -> str | None:
    """The type of the file system holding ``path`` (from /proc/self/mountinfo)."""
    try:
        st = os.stat(path)
        dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        found = None
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                left, _, right = line.partition(" - ")
                if left.split()[2:3] == [dev] and right:
                    found = right.split()[0]
        return found
    except OSError:
        return None


def _swaps() -> list[str]:
    try:
        with open("/proc/swaps", encoding="utf-8", errors="replace") as fh:
            return [_unescape(line.split()[0]) for line in fh.readlines()[1:] if line.strip()]
    except OSError:
        return []


def _loops() -> list[dict[str, Any]]:
    """Every attached loop device: name, back-file, back-ino, back-maj:min (stripped)."""
    if shutil.which("losetup") is None:
        return []
    out = subprocess.run(["losetup", "--list", "--json", "--output",
                          "NAME,BACK-FILE,BACK-INO,BACK-MAJ:MIN"],
                         capture_output=True, text=True, timeout=30)
    if out.returncode != 0 or not out.stdout.strip():
        return []
    try:
        loops = json.loads(out.stdout).get("loopdevices", [])
    except ValueError:
        return []
    for lo in loops:
        for k, v in list(lo.items()):
            if isinstance(v, str):
                lo[k] = v.strip()
    return loops


def _our_loops(disk: str, fuse_dev: str | None) -> list[str]:
    """Loop devices backed by our ``disk``: same FUSE device number and inode when known
    (exact even after the mount went away), else the same backing path."""
    # A file of a lazily detached mount shows as "/disk": accepted only together with our
    # FUSE device number and inode (a number that stays ours while a loop holds the file).
    found = []
    for lo in _loops():
        path = lo.get("back-file")
        if fuse_dev and lo.get("back-maj:min") == fuse_dev:
            if str(lo.get("back-ino")) == str(DISK_INO) and path in (disk, "/" + DISK_NAME):
                found.append(lo["name"])
        elif path == disk:
            found.append(lo["name"])
    return found


def _run(cmd: list[str], what: str, timeout: float = _CMD_TIMEOUT) -> str:
    if shutil.which(cmd[0]) is None:
        raise FileNotFoundError(errno.ENOENT, f"{what}: `{cmd[0]}` is not installed "
                                              f"(util-linux / fuse3)")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"{what}: `{' '.join(cmd)}` did not finish in {timeout:g} s") from None
    if out.returncode != 0:
        msg = (out.stderr or out.stdout).strip().splitlines()
        raise OSError(errno.EIO, f"{what}: `{' '.join(cmd)}` failed: "
                                 f"{msg[-1] if msg else f'exit status {out.returncode}'}")
    return out.stdout


def _swapoff(loop: str) -> bool:
    """swapoff if ``loop`` is a swap area; True if it was one."""
    if loop not in _swaps():
        return False
    try:
        _run(["swapoff", loop], f"swapoff {loop}")
    except (OSError, TimeoutError) as exc:
        if loop not in _swaps():
            return True
        raise SwapStillActive(errno.EBUSY, str(exc)) from None
    return True


def _loop_attached(loop: str) -> bool:
    return os.path.exists(f"/sys/block/{os.path.basename(loop)}/loop/backing_file")


def _detach_loop(loop: str, wait: float = 10.0) -> bool:
    """losetup -d and wait until the kernel let go of the backing file; True if it was
    attached."""
    if not _loop_attached(loop):
        return False
    try:
        _run(["losetup", "-d", loop], f"detach {loop}", timeout=60)
    except OSError:
        if _loop_attached(loop):
            raise
    deadline = time.monotonic() + wait
    while _loop_attached(loop) and time.monotonic() < deadline:
        time.sleep(0.05)        # a brief opener (udev, blkid) delays an autoclear detach
    if _loop_attached(loop):
        raise OSError(errno.EBUSY, f"{loop} is still attached {wait:g} s after losetup -d "
                                   f"(something holds it open)")
    return True


def _unmount_dead(mount: str) -> bool:
    """Detach a FUSE mount whose server is gone; True if one was mounted."""
    if not (_mount_type(mount) or "").startswith("fuse"):
        return False
    cmd = ["umount", "-l", mount] if os.geteuid() == 0 else ["fusermount3", "-u", "-z", mount]
    _run(cmd, f"unmount {mount}", timeout=60)
    return True


# ---- cleanup of a mount whose device process is gone ----

def remains(mount: str | os.PathLike[str], directory: str | None = None) -> list[str]:
    """What is still up for a mount directory: a FUSE mount there, loop devices backed
    by its ``disk``, swap on them (empty: nothing left)."""
    mount = _norm(mount)
    state = read_state(mount, directory) or {}
    left = []
    loops = _our_loops(os.path.join(mount, DISK_NAME), state.get("fuse_dev"))
    swaps = _swaps()
    left += [f"swap on {lo}" for lo in loops if lo in swaps]
    left += [f"loop device {lo}" for lo in loops]
    if (_mount_type(mount) or "").startswith("fuse"):
        left.append(f"FUSE mount at {mount}")
    return left


def cleanup(mount: str | os.PathLike[str], directory: str | None = None) -> list[str]:
    """Take down what is left of a mount whose device process is gone, in reverse order:
    swapoff, losetup -d, unmount the (dead) FUSE mount, remove the state file (and the
    mount directory if the device created it).  Returns what it did.  Raises OSError
    when a step fails (the state file stays)."""
    mount = _norm(mount)
    spath = state_path(mount, directory)
    state = read_state(mount, directory) or {}
    disk = os.path.join(mount, DISK_NAME)
    done: list[str] = []
    loops = _our_loops(disk, state.get("fuse_dev"))
    for lo in loops:
        if _swapoff(lo):
            done.append(f"swapoff {lo}")
    for lo in loops:
        if _detach_loop(lo):
            done.append(f"losetup -d {lo}")
    if _unmount_dead(mount):
        done.append(f"unmounted {mount}")
    if state.get("mount_created"):
        try:
            os.rmdir(mount)
        except OSError:
            pass
    _remove(spath)
    return done


# ---- the front end ----

def _process_start(pid: int) -> float | None:
    import psutil
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def owner_alive(state: dict | None) -> bool:
    """Whether the process that recorded ``state`` still runs (same pid *and* start time,
    so a reused pid does not count; a zombie does not count)."""
    import psutil
    pid = int((state or {}).get("pid") or 0)
    if pid <= 0:
        return False
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        start = (state or {}).get("pid_start")
        return start is None or abs(p.create_time() - float(start)) < 1.0
    except psutil.Error:
        return False


class Frontend:
    """FUSE file (+ loop device (+ swap)) for an open device; see the module doc.

    ``device``: a :class:`CoreDevice` or anything with a ``core`` attribute holding one
    (an :class:`infiniswap.Device`); it must stay open until :meth:`stop` returned.
    ``mount``: the mount directory (created if missing, and removed again).  ``swap``
    needs ``loop``.  ``swap_priority``: ``swapon --priority`` (None: the kernel's
    default).  ``state_dir``: where the state file goes (default :func:`state_dir`).
    """

    def __init__(self, device: Any, mount: str | os.PathLike[str], *, loop: bool = False,
                 swap: bool = False, swap_priority: int | None = None,
                 fsname: str = "infiniswap", state_dir: str | None = None) -> None:
        core = device if isinstance(device, CoreDevice) else getattr(device, "core", None)
        if not isinstance(core, CoreDevice):
            raise TypeError("device must be a CoreDevice or an infiniswap.Device")
        if swap and not loop:
            raise ValueError("swap needs a loop device: pass loop=True")
        if swap_priority is not None and not -1 <= int(swap_priority) <= 32767:
            raise ValueError(f"swap priority {swap_priority} must be in -1..32767")
        if swap and _fs_type(core.backup_path) in ("tmpfs", "ramfs"):
            # DESIGN.md §4: tmpfs pages can be swapped out into this very device, and the
            # device needs them to read its backup file: a page-in that waits on itself.
            raise ValueError(f"the backup file {core.backup_path} is on "
                             f"{_fs_type(core.backup_path)}: its pages could be swapped out "
                             f"into this swap device, which deadlocks; put it on a disk "
                             f"file system")
        self._core = core
        self.mountpoint = _norm(mount)
        self.want_loop, self.want_swap = bool(loop), bool(swap)
        self.swap_priority = swap_priority
        self.fsname = fsname
        self._state_dir = state_dir
        self._state_path = state_path(self.mountpoint, state_dir)
        self._fuse: FuseServer | None = None
        self._created_mount = False
        self.loop_device: str | None = None
        self.swap_on = False
        self._fuse_dev: str | None = None
        self._owns_state = False        # the state file is ours to update and remove

    # ---- facts ----

    @property
    def disk_path(self) -> str:
        return os.path.join(self.mountpoint, DISK_NAME)

    @property
    def fuse(self) -> FuseServer | None:
        return self._fuse

    @property
    def state_file(self) -> str:
        return self._state_path

    def state(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "pid": os.getpid(),
                "pid_start": _process_start(os.getpid()), "mount": self.mountpoint,
                "disk": self.disk_path, "fuse_dev": self._fuse_dev,
                "mount_created": self._created_mount, "loop": self.loop_device,
                "swap": self.swap_on, "swap_priority": self.swap_priority,
                "size": self._core.size}

    def _save(self) -> None:
        _write_state(self._state_path, self.state())
        self._owns_state = True

    # ---- lifecycle ----

    def start(self) -> "Frontend":
        if self._fuse is not None:
            raise RuntimeError(f"the front end at {self.mountpoint} is already started")
        prior = read_state(self.mountpoint, self._state_dir)
        if prior is not None:
            pid = int(prior.get("pid") or 0)
            if pid != os.getpid() and owner_alive(prior):
                raise OSError(errno.EBUSY, f"{self.mountpoint} is served by infiniswap "
                                           f"device pid {pid}: stop it first (infiniswap "
                                           f"device stop --mount {self.mountpoint})")
            log.warning("%s: state of a device (pid %s) that is gone: cleaning up first",
                        self.mountpoint, pid)
            for step in cleanup(self.mountpoint, self._state_dir):
                log.info("  %s", step)
        kind = _mount_type(self.mountpoint)
        if kind is not None:
            raise OSError(errno.EBUSY, f"{self.mountpoint} already has a {kind} file system "
                                       f"mounted")
        if not os.path.isdir(self.mountpoint):
            os.makedirs(self.mountpoint, mode=0o700)
            self._created_mount = True
        try:
            self._fuse = FuseServer(self._core, self.mountpoint, self.fsname)
            st = os.stat(self.mountpoint)
            self._fuse_dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
            self._save()
            log.info("serving %s (%d MiB) over FUSE", self.disk_path, self._core.size >> 20)
            if self.want_loop:
                self.loop_device = self._attach_loop()
                self._save()
            if self.want_swap:
                self._swapon()
        except BaseException:
            try:
                self.stop()
            except Exception as exc:        # keep the original error
                log.error("cleanup after a failed start: %s", exc)
            raise
        return self

    def _attach_loop(self) -> str:
        cmd = ["losetup", "--find", "--show", "--direct-io=on", "--sector-size", "4096",
               self.disk_path]
        for attempt in range(5):
            try:
                loop = _run(cmd, "attach a loop device", timeout=60).strip()
                break
            except OSError as exc:
                # --find races with other users of loop devices: try the next free one
                if attempt == 4 or "busy" not in str(exc).lower():
                    raise
                time.sleep(0.1 * (attempt + 1))
        name = os.path.basename(loop)
        try:
            with open(f"/sys/block/{name}/loop/dio", encoding="ascii") as fh:
                if fh.read().strip() != "1":
                    log.warning("%s: direct I/O is off: paging will be several times slower",
                                loop)
        except OSError:
            pass
        log.info("loop device %s on %s (direct I/O, 4 KiB sectors)", loop, self.disk_path)
        return loop

    def _swapon(self) -> None:
        assert self.loop_device is not None
        _run(["mkswap", "-L", "infiniswap", self.loop_device], f"mkswap {self.loop_device}")
        cmd = ["swapon"]
        if self.swap_priority is not None:
            cmd += ["--priority", str(int(self.swap_priority))]
        # recorded before swapon: a crash right after it must still be undone
        self.swap_on = True
        self._save()
        _run(cmd + [self.loop_device], f"swapon {self.loop_device}")
        log.info("swap on %s (priority %s)", self.loop_device,
                 self.swap_priority if self.swap_priority is not None else "default")

    def stop(self) -> None:
        """swapoff, losetup -d, stop FUSE (unmount), remove the state file — each only if
        up; idempotent.  Raises :class:`SwapStillActive` (nothing below the swap area was
        touched) or OSError naming the step that failed; calling again retries."""
        if self.swap_on and self.loop_device:
            _swapoff(self.loop_device)
            log.info("swapoff %s", self.loop_device)
            self.swap_on = False
            self._save()
        if self.loop_device:
            _detach_loop(self.loop_device)
            log.info("detached %s", self.loop_device)
            self.loop_device = None
            self._save()
        if self._fuse is not None:
            self._fuse.stop()
            log.info("unmounted %s", self.mountpoint)
            self._fuse = None
        if self._owns_state:
            _remove(self._state_path)
            self._owns_state = False
        if self._created_mount:
            try:
                os.rmdir(self.mountpoint)
            except OSError:
                pass
            self._created_mount = False

    def __enter__(self) -> "Frontend":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (f"<infiniswap.Frontend {self.disk_path} loop={self.loop_device} "
                f"swap={'on' if self.swap_on else 'off'}>")
