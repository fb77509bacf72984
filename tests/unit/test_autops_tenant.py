"""pMaster and a job's tenant, without a pool: the tenant is the name of the CURVE key the job's
first registration came with (none for the cluster's ``member`` key or without CURVE); a
registration from another key is refused (a job cannot change owner); the tenant is recorded
in the state directory and survives a restart; every command that commits an aggregator's
memory to the job names it. Driven through pMaster's dispatch with the CURVE peer name given
as the socket would give it, and a socket that records what pMaster would send."""
from __future__ import annotations

import json
import stat

import pytest

from autops.wire import clusterauth, protocol as wire
from autops.wire.jobauth import new_job_secret
from autops.master.pmaster import TENANT_OPS, Master, TenantOutbox
from autops.master.pool import AggInfo, JobInfo, PoolState, tenant_of, tenant_refused
from autops.master.poolfiles import TENANTS_FILE, JobTenants
from dlrt.curve import Security
from dlrt.keys import Keys

CLUSTER = bytes(range(32))
JOB = dict(world_size=2, num_aggregators=1, mode="sum")


# --- the policy ----------------------------------------------------------------------------
@pytest.mark.parametrize("peer, tenant", [(None, None), ("", None), ("member", None), ("alice", "alice")])
def test_the_tenant_is_the_keys_name_but_the_clusters_own_key_is_none(peer, tenant):
    assert tenant_of(peer) == tenant


@pytest.mark.parametrize("known, owner, tenant, refused", [
    (True, "alice", "alice", False), (True, "alice", "bob", True), (True, "alice", None, True),
    (True, None, "alice", True), (True, None, None, False),
    (False, None, "alice", False), (False, None, None, False)])      # adopted without a record: not yet
def test_a_job_cannot_change_owner(known, owner, tenant, refused):
    assert tenant_refused(known, owner, tenant) is refused


# --- the record on disk --------------------------------------------------------------------
def test_tenants_persist_in_the_state_directory_privately(tmp_path):
    first = JobTenants(tmp_path / "state")
    first.record("a", "alice")
    first.record("m", None)                      # no tenant is recorded too: its owner is known
    path = tmp_path / "state" / TENANTS_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = JobTenants(tmp_path / "state")       # a restarted pMaster
    assert again.jobs() == ["a", "m"] and again.get("a") == "alice"
    assert again.known("m") and again.get("m") is None and not again.known("x")
    again.forget("a")
    assert JobTenants(tmp_path / "state").jobs() == ["m"]
    memory = JobTenants(None)
    memory.record("a", "alice")
    assert memory.get("a") == "alice" and memory.path is None


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"a": 7, "b": "bob"}'])
def test_a_damaged_record_is_ignored_not_fatal(tmp_path, content):
    (tmp_path / TENANTS_FILE).write_text(content)
    tenants = JobTenants(tmp_path)
    assert not tenants.known("a")                # unknown: its next registration names it
    assert tenants.get("b") == ("bob" if content.startswith('{"a"') else None)


# --- pMaster's messages --------------------------------------------------------------------
class RecordingSocket:
    """Stands in for pMaster's ROUTER: keeps what it would send, per peer identity."""

    def __init__(self) -> None:
        self.sent: list[list] = []

    def send_multipart(self, frames: list) -> None:
        self.sent.append(frames)

    def last(self, identity: bytes) -> list:
        return [f[1:] for f in self.sent if f[0] == identity][-1]

    def to(self, identity: bytes) -> list[list]:
        return [f[1:] for f in self.sent if f[0] == identity]

    def close(self, linger: int = 0) -> None:
        pass


@pytest.fixture
def make_master(tmp_path):
    made = []

    def make(state_dir=tmp_path / "state") -> Master:
        master = Master("tcp://127.0.0.1:0", security=Security(Keys(tmp_path, None, None, None, None)),
                        state_dir=state_dir, cluster_secret=CLUSTER, operator_token="operator-token-tests")
        real, master.sock = master.sock, RecordingSocket()
        master.started -= 60.0                   # long up: registrations again (rejoin) are allowed
        made.append((master, real))
        return master

    yield make
    for master, real in made:
        real.close(0)
        master.secrets.close()
        master.ctx.term()


def ask(master: Master, identity: bytes, op: str, peer: str | None = None, **fields) -> wire.Message:
    master._dispatch([identity, *wire.encode(op, req=1, **fields)], peer=peer)
    return wire.decode(master.sock.last(identity)[:1])


def register_agg(master: Master, identity: bytes = b"agg", name: str = "agg-0") -> clusterauth.ControlSession:
    nonce = clusterauth.new_nonce()
    where = dict(endpoints={"tcp": "tcp://127.0.0.1:1"}, host="h", pid=1)
    hello = ask(master, identity, wire.REGISTER_AGG, nonce=nonce, **where)
    reply = ask(master, identity, wire.REGISTER_AGG, nonce=nonce, name=name, **where,
                answer=clusterauth.answer(CLUSTER, hello["challenge"], nonce))
    assert reply.op == wire.OK
    return clusterauth.ControlSession.for_aggregator(clusterauth.session_key(CLUSTER, nonce, hello["challenge"]))


def test_a_later_registration_from_another_key_is_refused_like_a_wrong_secret(make_master):
    master = make_master()
    register_agg(master)
    register_agg(master, b"agg2", name="agg-1")             # one for each job
    secret = new_job_secret()
    assert ask(master, b"a0", wire.REGISTER_JOB, "alice", job="j", rank=0, secret=secret, **JOB).op == wire.OK
    for identity, peer in [(b"b1", "bob"), (b"m1", "member"), (b"p1", None)]:
        reply = ask(master, identity, wire.REGISTER_JOB, peer, job="j", rank=1, secret=secret, **JOB)
        assert reply.op == wire.ERROR and reply["refused"] == "wrong_tenant", reply.fields
        assert "cannot change owner" in reply["message"] and "alice" not in reply["message"]
    # a wrong secret is still reported as that, whoever sends it
    reply = ask(master, b"b1", wire.REGISTER_JOB, "bob", job="j", rank=1, secret=new_job_secret(), **JOB)
    assert reply["refused"] == "wrong_secret"
    assert ask(master, b"a1", wire.REGISTER_JOB, "alice", job="j", rank=1, secret=secret, **JOB).op == wire.OK
    assert master.state.jobs["j"].ranks == {0, 1}
    assert master.status()["security"]["refusals"] == {"wrong_tenant": 3, "wrong_secret": 1}
    # a job registered with the cluster's own key has no tenant, and gets none later
    member = new_job_secret()
    reply = ask(master, b"m0", wire.REGISTER_JOB, "member", job="m", rank=0, secret=member, **JOB)
    assert reply.op == wire.OK, reply.fields
    assert ask(master, b"a2", wire.REGISTER_JOB, "alice", job="m", rank=1, secret=member,
               **JOB)["refused"] == "wrong_tenant"
    assert ask(master, b"m2", wire.REGISTER_JOB, None, job="m", rank=1, secret=member, **JOB).op == wire.OK
    tenants = {j["job"]: j["tenant"] for j in master.status()["jobs"]}
    assert tenants == {"j": "alice", "m": None}


def test_commands_that_commit_memory_to_the_job_name_its_tenant(make_master):
    master = make_master()
    sessions = {b"agg": register_agg(master), b"agg2": register_agg(master, b"agg2", name="agg-1")}
    for job, peer in (("a", "alice"), ("m", "member")):
        secret = new_job_secret()
        assert ask(master, job.encode(), wire.REGISTER_JOB, peer, job=job, rank=0, secret=secret,
                   **dict(JOB, world_size=1)).op == wire.OK
        master._dispatch([job.encode(), *wire.encode(wire.DECLARE, req=2, job=job, secret=secret,
                                                     tensors=[["w", [1024], "float32"]])], peer=peer)
    assigns = {}
    for identity, session in sessions.items():
        for frames in master.sock.to(identity):
            msg = wire.decode(session.open(frames) or frames)
            if msg.op == wire.ASSIGN:
                assigns[msg["job"]] = msg.fields
    assert assigns["a"]["tenant"] == "alice" and "tenant" not in assigns["m"], assigns


def test_the_outbox_names_the_tenant_in_every_memory_command_and_no_other():
    state = PoolState()
    state.add_aggregator(AggInfo("agg-0", b"agg", {}, "h", 1, state.clock()))
    job = JobInfo("a", "s" * 32, 1, 1, "sum", True, None, {}, 1 << 20, 1 << 16, ["agg-0"])
    job.tenant = "alice"
    state.jobs["a"] = job
    state.jobs["m"] = JobInfo("m", "s" * 32, 1, 1, "sum", True, None, {}, 1 << 20, 1 << 16, ["agg-0"])
    sent = []
    outbox = TenantOutbox(state, lambda identity, frames: sent.append(wire.decode(frames)), 5.0)
    assert TENANT_OPS == {wire.ASSIGN, wire.MIGRATE_PREPARE, wire.REPLICA_PREPARE, wire.FAILOVER}
    for op in sorted(TENANT_OPS) + [wire.RELEASE_JOB, wire.MIGRATE_DROP]:
        for name in ("a", "m"):
            sent.clear()
            outbox.send_agg("agg-0", op, None, job=name, secret="s" * 32, world_size=1, mode="sum", mid=1,
                            keys=[])
            assert sent[0].get("tenant") == ("alice" if name == "a" and op in TENANT_OPS else None), (op, name)


def test_the_tenant_survives_a_restart_and_goes_with_the_job(make_master):
    first = make_master()
    register_agg(first)
    secret = new_job_secret()
    assert ask(first, b"a0", wire.REGISTER_JOB, "alice", job="j", rank=0, secret=secret, **JOB).op == wire.OK
    restarted = make_master()                                # same state directory, empty pool
    register_agg(restarted, b"agg2", name="agg-1")
    restarted._adopt(restarted.state.aggs["agg-1"], {"j": {"secret": secret, "world_size": 2, "keys": []}})
    assert restarted.state.jobs["j"].tenant == "alice"
    again = dict(job="j", rank=0, secret=secret, rejoin=True, **JOB)
    assert ask(restarted, b"b0", wire.REGISTER_JOB, "bob", **again)["refused"] == "wrong_tenant"
    assert ask(restarted, b"a0", wire.REGISTER_JOB, "alice", **again).op == wire.OK
    restarted.release_job("j")
    assert restarted.tenants.jobs() == [] and json.loads((restarted.tenants.path).read_text()) == {}


def test_a_job_adopted_without_a_record_takes_the_tenant_of_its_next_registration(make_master):
    master = make_master(state_dir=None)                     # nothing survived the restart
    register_agg(master)
    secret = new_job_secret()
    master._adopt(master.state.aggs["agg-0"], {"j": {"secret": secret, "world_size": 2, "keys": []}})
    assert not master.state.jobs["j"].tenant_known
    again = dict(job="j", secret=secret, rejoin=True, **JOB)
    assert ask(master, b"a0", wire.REGISTER_JOB, "alice", rank=0, **again).op == wire.OK
    assert ask(master, b"b1", wire.REGISTER_JOB, "bob", rank=1, **again)["refused"] == "wrong_tenant"
    assert master.state.jobs["j"].tenant == "alice" and master.tenants.get("j") == "alice"
