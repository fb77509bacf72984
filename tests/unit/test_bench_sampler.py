"""ProcFiles (dlrt_bench/sampler.py): files kept open and read again from their start, as the
benchmarks' samplers read /proc."""
import os
import subprocess
import sys
import time

import pytest

from dlrt_bench.autops_elastic import stat_counters
from dlrt_bench.sampler import ProcFiles


def test_a_file_kept_open_reads_what_it_holds_now(tmp_path):
    path = tmp_path / "counters"
    path.write_text("a 1\n")
    files = ProcFiles()
    assert files.read(str(path)) == "a 1\n"
    path.write_text("a 22\nb 3\n")                 # rewritten in place, as /proc's texts are made afresh
    assert files.read(str(path)) == "a 22\nb 3\n"
    files.close()


def test_proc_texts_are_made_afresh_for_every_read():
    files = ProcFiles()
    path = f"/proc/{os.getpid()}/stat"

    def cpu_ticks() -> int:
        return stat_counters(files.read(path))[0]

    before = cpu_ticks()
    burning = time.process_time()
    # burn CPU until the kept-open file shows the kernel counted a tick (10 ms at HZ=100),
    # giving up after 5 s of CPU: a text read once and kept would never change
    while cpu_ticks() == before and time.process_time() - burning < 5.0:
        sum(range(10**4))
    assert cpu_ticks() > before
    files.close()


def test_a_process_gone_raises_and_its_file_is_closed():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    files = ProcFiles()
    path = f"/proc/{child.pid}/stat"
    try:
        assert files.read(path).startswith(f"{child.pid} (")
    finally:
        child.kill()
        child.wait()
    with pytest.raises(OSError):
        files.read(path)
    assert path not in files._fds
    with pytest.raises(OSError):                   # opened anew: the process is gone
        files.read(path)
