"""``infiniswap device --size`` against the space available for its backup file.

With ``--swap`` a size beyond it is refused: one line, exit 2, nothing created (no backup
file, no mount dir). Without ``--swap`` the device warns and runs. ``available_for`` counts
what an existing backup file holds, since the device truncates it."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest

from infiniswap.backupspace import available_for, backup_shortfall

pytestmark = pytest.mark.timeout(90)

MiB = 1 << 20
CLI = [sys.executable, "-m", "infiniswap.cli"]


def too_big(directory) -> int:
    """A device size (a multiple of 1 MiB) 1 GiB beyond the space available in ``directory``."""
    return (available_for(directory / "x") // MiB + 1024) * MiB


def test_available_space_counts_an_existing_file_the_device_truncates(tmp_path):
    target = tmp_path / "backup"
    before = available_for(target)
    target.write_bytes(os.urandom(4 * MiB))
    os.fsync(os.open(target, os.O_RDONLY))
    after = available_for(target)
    assert abs(after - before) < 2 * MiB            # the file's blocks count as available
    assert available_for(tmp_path / "no-such-dir" / "backup") is None
    assert backup_shortfall(tmp_path / "no-such-dir" / "backup", 1 << 62) is None


def test_shortfall_names_the_size_the_space_and_the_file(tmp_path, monkeypatch):
    class FakeFs:
        f_bavail, f_frsize = 256, 4096              # 1 MiB available
    monkeypatch.setattr(os, "statvfs", lambda path: FakeFs)
    assert backup_shortfall(tmp_path / "b", MiB) is None
    text = backup_shortfall(tmp_path / "b", 2 * MiB)
    assert text == f"--size 2.0 MiB exceeds the 1.0 MiB available for the backup file {tmp_path / 'b'} on its file system"


def test_swap_with_a_size_beyond_the_disk_is_refused_and_nothing_is_created(tmp_path):
    backup, mount = tmp_path / "swap.img", tmp_path / "mnt"
    out = subprocess.run([*CLI, "device", "--size", str(too_big(tmp_path)), "--slab-size", "1M",
                          "--backup", str(backup), "--daemons", "127.0.0.1:9", "--mount", str(mount),
                          "--swap"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("infiniswap device: error: --size "), out.stderr
    assert "available for the backup file" in lines[0] and "pages written past it would be lost" in lines[0]
    assert not backup.exists() and not mount.exists()


def test_without_swap_a_size_beyond_the_disk_is_a_warning(tmp_path):
    backup = tmp_path / "sparse.img"
    proc = subprocess.Popen([*CLI, "device", "--size", str(too_big(tmp_path)), "--slab-size", "1M",
                             "--backup", str(backup), "--daemons", "127.0.0.1:9", "--timeout", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline and not line:
            if select.select([proc.stdout], [], [], 0.2)[0]:
                line = proc.stdout.readline()
            elif proc.poll() is not None:
                break
        assert line.startswith("infiniswap device:"), proc.stderr.read() if proc.poll() is not None else ""
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        err = proc.stderr.read()
        assert "available for the backup file" in err and "a disk write past it fails" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()
        backup.unlink(missing_ok=True)
