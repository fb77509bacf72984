"""The master's dashboard, rendered by headless Chromium (Debian's ``chromium``).

A real master runs jobs on two emulated nodes; Chromium loads ``/#token=TOKEN`` (loopback
callers need a token too: the login page posts the fragment's token to ``/login``, which sets
the cookie, and reloads), runs the page's script, and the DOM it dumps must show the nodes, the
running jobs on the GPU map, the waiting job with its reason, and the events. Without the
token the page is the login form and shows no job.
"""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "integration"))
from tiresias_live import MasterProcess, counter, wait_for  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def render(url: str, tmp_path, screenshot: str | None = None) -> str:
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            f"--user-data-dir={tmp_path / 'chromium-profile'}", "--virtual-time-budget=5000",
            "--window-size=1280,900"]
    if screenshot:
        args.append(f"--screenshot={screenshot}")
    else:
        args.append("--dump-dom")
    out = subprocess.run(args + [url], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.timeout(240)
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make test installs Debian's chromium)")
def test_dashboard_shows_nodes_jobs_queue_and_events(tmp_path):
    m = MasterProcess(tmp_path / "state", "--nodes", "2x2", "--interval", "0.5").start()
    try:
        a = m.submit(2, *counter(400, 0.1), name="resnet-a")
        b = m.submit(2, *counter(400, 0.1), name="vgg-b")
        c = m.submit(3, *counter(5, 0.1), name="bert-c")
        for job_id in (a, b):
            m.wait_status(job_id, "running")
        wait_for(lambda: m.job(c)["reason"], 10, "the waiting job's reason")
        bare = render(m.client.url + "/", tmp_path / "bare")
        assert "resnet-a" not in bare and "token" in bare
        url = m.client.url + "/#token=" + m.client.token
        dom = render(url, tmp_path)
        for text in ("node0", "node1", "resnet-a", "vgg-b", "bert-c", f"j{a}", f"j{b}", "started",
                     "submitted", "policy", "las", "GPUs", "4/4"):
            assert text in dom, f"{text!r} not on the dashboard"
        assert "not enough free GPUs" in dom or "queued behind" in dom
        shot = tmp_path / "dashboard.png"
        render(url, tmp_path, screenshot=str(shot))
        assert shot.stat().st_size > 10_000
    finally:
        m.stop()
