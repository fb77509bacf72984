"""The README's Tiresias snippets, run as written.

Each block is found in README.md by the comment line ``<!-- tests/e2e/test_readme_snippets.py
runs this block: NAME -->`` just above it.

* ``tiresias-live``: the live quick start, command by command, in a fresh ``$HOME`` (so the
  default state dirs and keys are the test's own). Commands ending in ``&`` are started in
  the background and awaited; the others must exit 0. The only change: the fixed ports
  (pMaster's 5555, the master's 8470) become free ones. Both jobs must end ``finished``.
* ``tiresias-elastic``: the elastic quick start the same way; the job ends ``finished`` with
  the accuracy of an ordinary run, and ``tiresias job 1`` shows its allocation and model.
* ``preemption``: the snippet is the loop of a 2-worker ``server``-mode AutoPS job (the
  lines around it define ``start``, ``steps``, ``train_one_step`` (it returns the loss) and
  ``save_checkpoint``); the master shows the steps and losses the job reports,
  submitted to a master over a pool of 2 aggregators that keeps a job's registration for
  600 s without word from it. The job is preempted (its node drained) after a few steps,
  checkpoints, exits through ``job.exit_stopped()`` on both ranks at the same step, and its
  resumed run is admitted by the pool at once (no ``requeued`` event) and ends ``finished``
  with every step done once.
"""
from __future__ import annotations

import os
import pathlib
import re
import shlex
import signal
import socket
import subprocess
import sys

import pytest

from dlrt.procs import signal_group
from tiresias.service.client import Client
from tiresias.service.launch import kill_runs
from waiting import wait_for
from ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = pathlib.Path(sys.executable).parent
MARKER = "<!-- tests/e2e/test_readme_snippets.py runs this block: {} -->"


def readme_block(name: str) -> str:
    """The fenced block right below the README's marker ``name``."""
    text = (ROOT / "README.md").read_text()
    marker = MARKER.format(name)
    assert text.count(marker) == 1, f"README.md has no (single) marker {marker}"
    after = text.split(marker, 1)[1].lstrip("\n")
    match = re.match(r"```\w*\n(.*?)\n```", after, re.S)
    assert match, f"no fenced block right below {marker}"
    return match.group(1)


def shell_commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines dropped."""
    commands, pending = [], ""
    for line in block.splitlines():
        line = pending + line
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        pending = ""
        code = line.split(" #", 1)[0].strip()
        if code and not code.startswith("#"):
            commands.append(code)
    return commands


def accepting(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class Session:
    """A shell session of the README's reader: a fresh $HOME, the venv's tools first on PATH,
    the repository as the working directory; background commands are stopped at the end."""

    def __init__(self, tmp: pathlib.Path) -> None:
        self.home = tmp / "home"
        self.home.mkdir()
        self.logs = tmp / "logs"
        self.logs.mkdir()
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("TIRESIAS_", "AUTOPS_", "DLRT_REQUEUE"))}
        self.env.update(HOME=str(self.home), PATH=f"{BIN}{os.pathsep}{self.env.get('PATH', '')}",
                        OMP_NUM_THREADS="1")
        self.background: list[subprocess.Popen] = []
        self.pmaster_port = free_port()

    @property
    def state(self) -> pathlib.Path:
        return self.home / ".tiresias"

    def adapt(self, command: str) -> str:
        """The command with free ports in place of the README's fixed ones."""
        command = command.replace("tcp://127.0.0.1:5555", f"tcp://127.0.0.1:{self.pmaster_port}")
        if command.startswith("autops master"):
            command = command.replace("autops master", f"autops master --bind 127.0.0.1:{self.pmaster_port}", 1)
        if command.startswith("tiresias master"):
            command = command.replace("tiresias master", "tiresias master --bind 127.0.0.1:0", 1)
        if command.startswith("autops status"):
            command += f" --master tcp://127.0.0.1:{self.pmaster_port}"
        return command

    def line(self, command: str) -> str:
        """One line of a sh block: ``CMD &`` started, ``export NAME=$(CMD)`` sets NAME to the
        command's output, ``NAME=VALUE ... CMD`` runs CMD with those variables; the output."""
        if command.endswith("&"):
            self.start(command)
            return ""
        exported = re.fullmatch(r"export (\w+)=\$\((.*)\)", command)
        if exported:
            self.env[exported.group(1)] = self.run(exported.group(2)).stdout.strip()
            return ""
        words = shlex.split(command)
        assigned = {}
        while words and re.fullmatch(r"\w+=.*", words[0]):
            name, value = words.pop(0).split("=", 1)
            assigned[name] = self.adapt(value)
        saved = dict(self.env)
        self.env.update(assigned)
        try:
            return self.run(shlex.join(words)).stdout
        finally:
            self.env = saved

    def start(self, command: str) -> None:
        """A ``CMD &`` line: started, then awaited until it serves."""
        command = self.adapt(command.rstrip("&").strip())
        log = open(self.logs / f"bg{len(self.background)}.log", "wb")
        self.background.append(subprocess.Popen(shlex.split(command), cwd=ROOT, env=self.env, stdout=log,
                                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                start_new_session=True))
        log.close()
        proc = self.background[-1]
        if command.startswith("autops master"):
            wait_for(lambda: proc.poll() is not None or accepting(self.pmaster_port), 60, "pMaster")
        elif command.startswith("tiresias master"):
            wait_for(lambda: proc.poll() is not None or (self.state / "master.json").exists(), 60, "the master")
        assert proc.poll() is None, f"{command!r} exited {proc.returncode}: {self.log_tail()}"

    def run(self, command: str, timeout: float = 300) -> subprocess.CompletedProcess:
        done = subprocess.run(shlex.split(self.adapt(command)), cwd=ROOT, env=self.env, capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, f"{command!r} exited {done.returncode}:\n{done.stdout[-2000:]}" \
                                     f"\n{done.stderr[-2000:]}\n{self.log_tail()}"
        return done

    def client(self) -> Client:
        return Client.from_state(str(self.state))

    def job(self, job_id: int) -> dict:
        return self.client().get(f"/api/v1/jobs/{job_id}")

    def events(self, job_id: int) -> list[dict]:
        return self.client().get(f"/api/v1/events?job={job_id}&limit=200")

    def log_tail(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(self.logs.iterdir()))

    def close(self) -> None:
        """SIGTERM every background command's process group (pMaster's aggregators die with it),
        then whatever the master's runs left; SIGKILL what is still there."""
        for proc in reversed(self.background):
            if proc.poll() is None:
                signal_group(proc.pid, signal.SIGTERM)
        for proc in reversed(self.background):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait(10)
        if self.state.exists():
            kill_runs(self.state)


@pytest.fixture
def session(tmp_path):
    s = Session(tmp_path)
    try:
        yield s
    finally:
        s.close()


def wait_done(session: Session, job_id: int, timeout: float) -> dict:
    view = wait_for(lambda: (j := session.job(job_id))["status"] in ("finished", "failed", "cancelled") and j,
                    timeout, f"job {job_id} to end")
    assert view["status"] == "finished", f"job {job_id}: {view}\n{session.log_tail()}"
    return view


def test_tiresias_live_quick_start_runs_as_written(session):
    commands = shell_commands(readme_block("tiresias-live"))
    assert [c.split()[:2] for c in commands][:3] == [["autops", "master"], ["tiresias", "master"],
                                                      ["tiresias", "submit"]]
    outputs = {}
    for command in commands:
        if command.endswith("&"):
            session.start(command)
        else:
            outputs[command] = session.run(command).stdout
    submitted = [int(re.search(r"\d+", out).group()) for c, out in outputs.items() if c.startswith("tiresias submit")]
    assert submitted == [1, 2]
    follow = next(out for c, out in outputs.items() if c.startswith("tiresias logs"))
    assert "test accuracy" in follow                # `tiresias logs 1 --follow` saw job 1 to its end
    for job_id in submitted:
        wait_done(session, job_id, 600)


def test_tiresias_elastic_quick_start_runs_as_written(session):
    commands = shell_commands(readme_block("tiresias-elastic"))
    assert [c.split()[:2] for c in commands] == [["autops", "master"], ["tiresias", "master"],
                                                 ["tiresias", "submit"], ["tiresias", "job"]]
    outputs = {}
    for command in commands:
        if command.endswith("&"):
            session.start(command)
        else:
            outputs[command] = session.run(command).stdout
    shown = next(out for c, out in outputs.items() if c.startswith("tiresias job"))
    assert "1-4" in shown and "model:" in shown, shown
    view = wait_done(session, 1, 600)
    assert view["min_gpus"] == 1 and view["runs"], view
    log = session.run("tiresias logs 1").stdout
    accuracy = float(re.findall(r"test accuracy ([0-9.]+)", log)[-1])
    assert accuracy >= 0.9, log[-2000:]


PRELUDE = '''\
"""A 2-worker server-mode AutoPS job around the README's preemption snippet."""
import os, time
import torch
import autops.torch as aps
from tiresias import job

torch.set_num_threads(1)
aps.init()
rank = aps.rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
opt = aps.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                               named_parameters=model.named_parameters(), mode="server")
aps.broadcast_parameters(model.state_dict(), root_rank=0)
x, y = torch.randn(32, 64, generator=torch.Generator().manual_seed(rank)), torch.arange(32) % 4
steps, start = STEPS, 0
saved = job.checkpoint_dir() / "ckpt.pt"
if saved.exists():
    ckpt = torch.load(saved)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    start = ckpt["next"]
    print(f"rank {rank} resumed at step {start}", flush=True)


def train_one_step():
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    print(f"rank {rank} step {step}", flush=True)
    time.sleep(0.05)
    return loss.item()


def save_checkpoint(directory):
    if rank == 0:                            # server mode: state_dict() fetches the aggregators' state
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "next": step + 1},
                   directory / "ckpt.pt")
        print(f"rank 0 saved at step {step}", flush=True)
    else:
        print(f"rank {rank} stopped at step {step}", flush=True)

'''
EPILOGUE = '''
print(f"rank {rank} finished {steps} steps", flush=True)
'''


def test_preemption_snippet_stops_resumes_on_the_pool_and_finishes(session, tmp_path):
    snippet = readme_block("preemption")
    assert "job.should_stop()" in snippet and "job.exit_stopped()" in snippet
    script = tmp_path / "preemptible.py"
    script.write_text(PRELUDE.replace("STEPS", "160") + snippet + "\n" + EPILOGUE)
    session.start("autops master --provider local --max-aggregators 2 --job-timeout 600 &")
    session.start(f"tiresias master --nodes 2x2 --interval 0.5 --stop-grace 120 "
                  f"--autops-master tcp://127.0.0.1:5555 &")
    out = session.run(f"tiresias submit --gpus 2 --autops-aggregators 2 -- {script}").stdout
    job_id = int(re.search(r"\d+", out).group())
    log = session.state / "jobs" / str(job_id) / "job.log"
    wait_for(lambda: log.exists() and "rank 1 step 15" in log.read_text(), 300, "the job to train a few steps")
    wait_for(lambda: (session.job(job_id).get("progress") or {}).get("step", 0) >= 10, 60,
             "the master to show the steps and losses the job reported")
    view = session.job(job_id)
    assert view["status"] == "running" and view["progress"]["loss"] > 0
    for node in sorted(view["placement"]):
        session.run(f"tiresias drain {node}")
    wait_for(lambda: any(e["kind"] == "preempted" for e in session.events(job_id)), 120, "the job to stop")
    for node in sorted(view["placement"]):
        session.run(f"tiresias undrain {node}")
    wait_done(session, job_id, 600)
    text = log.read_text()
    saved = int(re.search(r"rank 0 saved at step (\d+)", text).group(1))
    assert f"rank 1 stopped at step {saved}" in text                 # both ranks at the same step
    assert f"rank 0 resumed at step {saved + 1}" in text and f"rank 1 resumed at step {saved + 1}" in text
    for rank in (0, 1):
        done = [int(s) for s in re.findall(rf"rank {rank} step (\d+)", text)]
        assert sorted(done) == list(range(160)), f"rank {rank}: steps run {len(done)}"   # each once
        assert f"rank {rank} finished 160 steps" in text
    kinds = [e["kind"] for e in session.events(job_id)]
    assert "preempted" in kinds and "resumed" in kinds and "requeued" not in kinds, kinds
    preempted = next(e["detail"] for e in session.events(job_id) if e["kind"] == "preempted")
    assert "checkpointed and exited" in preempted


def test_autops_pool_block_runs_as_written(session):
    """pMaster with the local provider, a job's secret, a 2-worker job against it (on
    aggregators pMaster started for it), ``autops status`` after it."""
    commands = shell_commands(readme_block("autops-pool"))
    assert commands[0].startswith("autops master") and commands[-1].startswith("autops status")
    outputs = [session.line(c) for c in commands]
    assert session.env["AUTOPS_JOB_SECRET"]
    assert float(re.search(r"test accuracy ([\d.]+)", outputs[2]).group(1)) >= 0.95, outputs[2]
    assert "aggregators ['local-" in outputs[2], outputs[2]
    assert "Aggregators:" in outputs[3] and "Jobs:" in outputs[3], outputs[3]
