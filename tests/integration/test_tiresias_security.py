"""The live master's security with real processes: per-user tokens through the CLI, an
attacker that cannot change a victim's job, per-job AutoPS secrets in the jobs' environment,
and jobs run as their owners' OS users (as root).

Each test runs a real ``tiresias master`` (local executor, 127.0.0.1, port 0) and the
``counter.py`` test job; ``--record-env`` makes it write what it was started with (its uid,
HOME and the sha256 of its AUTOPS_JOB_SECRET) to its checkpoint dir.
"""
from __future__ import annotations

import hashlib
import json
import os
import pwd
import secrets
import shutil
import sqlite3
import subprocess
import tempfile
import urllib.request

import pytest

from tiresias.service.client import Client, ClientError
from tiresias_live import BIN, MasterProcess, counter, steps, wait_for

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def master(tmp_path):
    started = []

    def start(*args, state=None):
        m = MasterProcess(state or tmp_path / "state", *args).start()
        started.append(m)
        return m
    yield start
    for m in started:
        m.stop()


def add_user(m: MasterProcess, name: str, role: str = "user") -> tuple[str, str]:
    """``tiresias master users add``: (token, path of a 0600 file holding it)."""
    r = m.cli("master", "users", "add", name, "--role", role, "--json", "-")
    assert r.returncode == 0, r.stderr
    token = json.loads(r.stdout)["token"]
    path = m.state.parent / f"{name}.token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return token, str(path)


def as_user(m: MasterProcess, token_file: str, *args: str) -> subprocess.CompletedProcess:
    """A client command with a user's token ($TIRESIAS_TOKEN_FILE) and the master's address (--state)."""
    return subprocess.run([str(BIN / "tiresias"), args[0], "--state", str(m.state), *args[1:]],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TIRESIAS_TOKEN_FILE": token_file})


def submit(client: Client, total: int, *flags: str, name: str) -> int:
    return client.post("/api/v1/jobs", {"gpus": 1, "name": name, "command": counter(total, 0.05, *flags),
                                        "launcher": "plain"})["id"]


def output(m: MasterProcess, job_id: int) -> list[str]:
    """The job's own output (the supervisor's dated '=== tiresias' lines left out)."""
    log = m.state / "jobs" / str(job_id) / "job.log"
    return [line for line in log.read_text().splitlines() if not line.startswith("=== tiresias")]


def metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        return resp.read().decode()


def record(m: MasterProcess, job_id: int) -> list[dict]:
    path = m.state / "checkpoints" / str(job_id) / "checkpoint" / "env.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def stored_secret(m: MasterProcess, job_id: int) -> str:
    with sqlite3.connect(m.state / "state.db") as db:
        return db.execute("SELECT secret FROM jobs WHERE id = ?", (job_id,)).fetchone()[0]


def test_an_attacker_cannot_see_or_stop_a_victims_job_and_its_result_is_unchanged(master):
    m = master("--nodes", "1x2", "--interval", "0.5")
    alice_token, alice_file = add_user(m, "alice")
    _, bob_file = add_user(m, "bob")
    _, carol_file = add_user(m, "carol", role="viewer")
    url = m.client.url
    alice = Client(url, alice_token)

    quiet = submit(alice, 20, name="victim")             # the same job with nobody around
    m.wait_status(quiet, "finished")

    victim = submit(alice, 20, name="victim")
    m.wait_status(victim, "running")
    for args in (("job", str(victim)), ("cancel", str(victim)), ("logs", str(victim))):
        r = as_user(m, bob_file, *args)
        assert r.returncode == 1 and f"no job {victim}" in r.stderr, (args, r.stderr)
    r = as_user(m, bob_file, "jobs", "--json", "-")
    assert r.returncode == 0 and json.loads(r.stdout) == []
    r = as_user(m, carol_file, "cancel", str(victim))          # a viewer reads, never cancels
    assert r.returncode == 1 and "viewer" in r.stderr
    r = as_user(m, carol_file, "job", str(victim), "--json", "-")
    assert r.returncode == 0 and json.loads(r.stdout)["owner"] == "alice"
    for token in ("", "not-a-token", alice_token[:-1]):
        with pytest.raises(ClientError) as err:
            Client(url, token).post(f"/api/v1/jobs/{victim}/cancel")
        assert err.value.status == 401
    done = m.wait_status(victim, "finished")
    assert done["preemptions"] == 0 and done["exit_code"] == 0
    assert steps(m.state, victim) == steps(m.state, quiet) == list(range(1, 21))
    assert output(m, victim) == output(m, quiet)              # the victim's result, bit for bit
    text = metrics(url)
    assert 'tiresias_auth_refusals_total{reason="no_token"} 1.0' in text
    assert 'tiresias_auth_refusals_total{reason="bad_token"} 2.0' in text
    assert 'tiresias_auth_refusals_total{reason="role"} 1.0' in text
    # alice sees her jobs, the operator everyone's; nothing of a token reaches the master's log
    r = as_user(m, alice_file, "jobs", "--json", "-")
    assert [j["id"] for j in json.loads(r.stdout)] == [quiet, victim]
    master_log = m.log.read_text()
    assert "refused POST /api/v1/jobs/" in master_log and alice_token not in master_log
    assert alice_token[:-1] not in master_log


def test_each_job_gets_its_own_secret_in_its_environment_the_same_after_preemption(master):
    m = master("--nodes", "1x2", "--interval", "0.5", "--stop-grace", "2", "--thresholds", "2")
    a = m.submit(2, *counter(30, 0.1, "--record-env"), name="long")
    m.wait_status(a, "running")
    wait_for(lambda: len(steps(m.state, a)) >= 12, 30, "job a to pass its threshold")
    b = m.submit(2, *counter(5, 0.1, "--record-env"), name="short")
    m.wait_status(b, "finished")
    done = m.wait_status(a, "finished")
    assert done["preemptions"] >= 1
    runs_a, runs_b = record(m, a), record(m, b)
    assert [r["run"] for r in runs_a] == [str(i) for i in range(1, done["run"] + 1)] and len(runs_a) >= 2
    secret_a, secret_b = stored_secret(m, a), stored_secret(m, b)
    assert {r["secret_sha256"] for r in runs_a} == {hashlib.sha256(secret_a.encode()).hexdigest()}
    assert runs_b[0]["secret_sha256"] == hashlib.sha256(secret_b.encode()).hexdigest() and secret_a != secret_b
    shown = json.dumps([m.client.get("/api/v1/jobs"), m.client.get(f"/api/v1/jobs/{a}"),
                        m.client.get("/api/v1/events?limit=1000"), m.client.get("/api/v1/dashboard")])
    shown += m.cli("logs", str(a)).stdout + m.log.read_text()
    assert secret_a not in shown and secret_b not in shown
    spec = m.state / "jobs" / str(a) / "run1" / "spec.json"
    assert oct(spec.stat().st_mode & 0o777) == "0o600"       # the run's spec holds the secret
    assert oct((m.state / "state.db").stat().st_mode & 0o777) == "0o600"


def test_users_commands_usage_and_refusals(master):
    m = master("--nodes", "1x1")
    r = m.cli("master", "users")
    assert r.returncode == 2 and "add" in r.stdout
    add_user(m, "dana")
    r = m.cli("master", "users", "add", "dana")
    assert r.returncode == 1 and "exists" in r.stderr
    r = m.cli("master", "users", "add", "Not A Name")
    assert r.returncode == 2 and "user name" in r.stderr
    r = m.cli("master", "users", "list", "--json", "-")
    assert [(u["name"], u["role"], u["revoked"]) for u in json.loads(r.stdout)] == [("dana", "user", None)]
    assert "token" not in r.stdout and "hash" not in r.stdout
    r = m.cli("master", "users", "revoke", "dana")
    assert r.returncode == 0
    r = as_user(m, str(m.state.parent / "dana.token"), "jobs")
    assert r.returncode == 1 and "token" in r.stderr
    r = m.cli("master", "users", "revoke", "dana")
    assert r.returncode == 1 and "no active user" in r.stderr
    r = subprocess.run([str(BIN / "tiresias"), "master", "users", "list", "--state", str(m.state.parent / "none")],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "no master state" in r.stderr


@pytest.fixture
def os_user():
    """A system user made for this test and removed afterwards (root only)."""
    if os.geteuid() != 0:
        pytest.skip("running jobs as their owners needs root (useradd, setuid)")
    if shutil.which("useradd") is None or shutil.which("userdel") is None:
        pytest.skip("useradd/userdel are not installed")
    name = f"dlrttest-{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--system", "--no-create-home", name], check=True, capture_output=True, timeout=30)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], capture_output=True, timeout=30)


# what a job running as its owner records: uid, HOME, its secret's sha256, and whether it could
# list another job's checkpoint dir ($OTHER); plain sh, as the venv's python may sit where
# another user cannot reach it
WHOAMI = ('mkdir -p "$TIRESIAS_CHECKPOINT_DIR" && ls "$OTHER" >/dev/null 2>&1; seen=$?; '
          'printf "%s %s %s %s\\n" "$(id -u)" "$HOME" "$(printf %s "$AUTOPS_JOB_SECRET" | sha256sum | cut -c1-64)" '
          '"$seen" > "$TIRESIAS_CHECKPOINT_DIR/whoami"')


def test_run_as_owner_runs_a_job_as_its_owners_os_user(master, os_user):
    base = tempfile.mkdtemp(prefix="dlrt-runas-", dir="/tmp")    # pytest's tmp dirs are 0700: unreachable
    os.chmod(base, 0o711)
    try:
        m = master("--nodes", "1x2", "--interval", "0.5", "--run-as-owner", state=os.path.join(base, "state"))
        token, _ = add_user(m, os_user.pw_name)
        ghost, _ = add_user(m, "ghost")                           # no OS user of that name
        with pytest.raises(ClientError, match="no OS user 'ghost'") as err:
            submit(Client(m.client.url, ghost), 3, name="nobody")
        assert err.value.status == 400
        ops = m.submit(1, "sh", "-c", WHOAMI, name="operators", env={"OTHER": "/"})
        m.wait_status(ops, "finished")
        other = str(m.state / "checkpoints" / str(ops) / "checkpoint")
        mine = Client(m.client.url, token).post("/api/v1/jobs", {
            "gpus": 1, "name": "mine", "command": ["sh", "-c", WHOAMI], "env": {"OTHER": other}})["id"]
        assert m.wait_status(mine, "finished")["exit_code"] == 0
        uid, home, digest, seen = (m.state / "checkpoints" / str(mine) / "checkpoint" / "whoami").read_text().split()
        assert (int(uid), home) == (os_user.pw_uid, os_user.pw_dir)
        assert digest == hashlib.sha256(stored_secret(m, mine).encode()).hexdigest()
        assert seen != "0"                                          # the operator's job's checkpoints: unreadable
        ops_uid = (m.state / "checkpoints" / str(ops) / "checkpoint" / "whoami").read_text().split()[0]
        assert int(ops_uid) == os.geteuid()                         # the operator's jobs: the master's user
        ckpt = m.state / "checkpoints" / str(mine)
        for path, mode in ((ckpt, 0o700), (ckpt / "control", 0o700), (m.state / "jobs" / str(mine) / "job.log", 0o600)):
            st = path.stat()
            assert (st.st_uid, st.st_mode & 0o777) == (os_user.pw_uid, mode), path
        assert (m.state / "checkpoints" / str(ops)).stat().st_mode & 0o777 == 0o700
        st = (m.state / "jobs" / str(mine) / "run1").stat()
        assert (st.st_uid, st.st_mode & 0o777) == (0, 0o700)       # the supervisor's records stay root's
        assert (m.state / "jobs" / str(mine)).stat().st_mode & 0o777 == 0o711
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_run_as_owner_never_looks_at_a_jobs_workdir_as_root(master, os_user):
    """A tenant names a root-only 0700 dir (or a path in it) as its workdir and reads a relative
    path: the submission is refused with one answer, the same for a path that does not exist."""
    base = tempfile.mkdtemp(prefix="dlrt-runas-", dir="/tmp")
    os.chmod(base, 0o711)
    vault = tempfile.mkdtemp(prefix="dlrt-vault-", dir="/tmp")      # root's, 0700
    try:
        os.chmod(vault, 0o700)
        secret_text = secrets.token_hex(8)
        with open(os.path.join(vault, "secret"), "w") as f:
            f.write(secret_text)
        os.makedirs(os.path.join(vault, "inner"))
        m = master("--nodes", "1x2", "--interval", "0.5", "--run-as-owner", state=os.path.join(base, "state"))
        token, _ = add_user(m, os_user.pw_name)
        tenant = Client(m.client.url, token)
        answers = []
        for workdir in (vault, os.path.join(vault, "inner"), os.path.join(vault, "nothing-here")):
            with pytest.raises(ClientError) as err:
                tenant.post("/api/v1/jobs", {"gpus": 1, "name": "peek", "command": ["cat", "secret"],
                                             "workdir": workdir})
            assert err.value.status == 400
            answers.append(str(err.value).replace(workdir, "WORKDIR"))
        assert answers[0] == answers[1] == answers[2] and "can enter" in answers[0], answers
        assert secret_text not in "".join(answers)
    finally:
        shutil.rmtree(vault, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
