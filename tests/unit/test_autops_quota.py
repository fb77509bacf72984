"""What an aggregator commits and to whom (``autops.aggregator.quota``, ``commitments.Commitments``): the
per-job cap and the per-tenant quota as plain data; keys arriving by migration, backups and
take-overs committed as declared keys are, and released when they leave or the job ends;
one connection cap shared by a process's stream listeners (``sockpoll.LinkBudget``)."""
from __future__ import annotations

import socket
import time

import pytest

from autops.aggregator import quota
from autops.wire import protocol as wire
from autops.wire.partition import KeySpec
from autops.aggregator.moves_state import Arrival
from autops.aggregator.quota import Limits, admit
from autops.aggregator.store import SecretMismatch
from autops.transport.sockpoll import LinkBudget, oldest_unvouched
from autops.transport.stream import StreamChannel, StreamListener

M = 1 << 20


# --- the policy, over plain data ------------------------------------------------------------
def test_a_job_past_the_per_job_cap_is_refused_naming_the_option():
    limits = Limits(max_job_bytes=10 * M, max_tenant_bytes=None)
    assert admit("a", 10 * M, {}, {}, limits)
    got = admit("a", 4 * M, {"a": 7 * M}, {}, limits)
    assert not got and got.reason == (f"job 'a': its keys need {4 * M} bytes ({7 * M} more held here), over this "
                                      f"aggregator's limit of {10 * M} bytes per job (--max-job-bytes)")


def test_a_tenants_jobs_together_are_held_to_its_quota_and_other_tenants_are_not():
    limits = Limits(max_job_bytes=10 * M, max_tenant_bytes=12 * M)
    committed = {"a1": 8 * M, "b1": 8 * M, "m1": 9 * M}
    tenants = {"a1": "alice", "a2": "alice", "b1": "bob", "m1": quota.MEMBER}
    got = admit("a2", 5 * M, committed, tenants, limits)
    assert not got
    assert "job 'a2' of tenant 'alice'" in got.reason and f"the tenant's jobs hold {8 * M}" in got.reason
    assert got.reason.endswith(f"limit of {12 * M} bytes per tenant (--max-tenant-bytes)")
    assert admit("a2", 4 * M, committed, tenants, limits)                  # exactly the quota
    assert admit("b2", 4 * M, committed, {**tenants, "b2": "bob"}, limits)
    # the services' own key and jobs of no known tenant: the per-job cap only
    assert admit("m2", 10 * M, committed, {**tenants, "m2": quota.MEMBER}, limits)
    assert admit("x", 10 * M, committed, tenants, limits)
    assert not admit("m1", 2 * M, committed, tenants, limits)              # ... which still applies
    # no quota configured
    assert admit("a2", 10 * M, committed, tenants, Limits(10 * M, None))


def test_asking_with_nothing_more_says_whether_a_job_fits_the_tenant_it_turns_out_to_have():
    limits = Limits(max_job_bytes=10 * M, max_tenant_bytes=12 * M)
    committed = {"a1": 8 * M, "a2": 6 * M}
    assert admit("a2", 0, committed, {"a1": "alice"}, limits)              # tenant unknown: fits
    assert not admit("a2", 0, committed, {"a1": "alice", "a2": "alice"}, limits)
    assert admit("a2", 0, committed, {"a1": "alice", "a2": "bob"}, limits)


def test_the_default_tenant_quota_is_the_per_job_default_but_never_below_the_per_job_cap():
    assert quota.default_tenant_bytes(4 * M, 100 * M) == 100 * M
    assert quota.default_tenant_bytes(400 * M, 100 * M) == 400 * M
    assert not quota.is_tenant(None) and not quota.is_tenant(quota.MEMBER) and quota.is_tenant("alice")


def test_the_connection_that_makes_room_is_the_oldest_not_vouched_for_in_its_handshake_first():
    conns = [("job", True, True, 0.0), ("greeted", True, False, 1.0), ("new", False, False, 5.0),
             ("newer", False, False, 6.0)]
    assert oldest_unvouched(conns) == "new"
    assert oldest_unvouched(conns[:2]) == "greeted"
    assert oldest_unvouched(conns[:1]) is None and oldest_unvouched([]) is None


# --- the aggregator's commitments (no pMaster: its answers are recorded) -----------------------
def spec(key: str, numel: int) -> list:
    return KeySpec(key, key, 0, numel, "float32", False).to_wire()


@pytest.fixture
def agg(monkeypatch):
    from autops.aggregator import service as aggregator_mod

    a = aggregator_mod.Aggregator("tcp://127.0.0.1:1", transport="tcp", register_timeout=0.1, ipc=False,
                                  max_job_bytes=10 * M, max_tenant_bytes=12 * M)     # plain memory: at once
    a.answers = []
    monkeypatch.setattr(a, "_to_master", lambda frames: a.answers.append(wire.decode(frames)))
    monkeypatch.setattr(a.commitments, "room", lambda: 1 << 40)         # the machine's room is memroom's test
    try:
        yield a
    finally:
        a.close()


HALF = M // 8      # float32s a sum-mode key commits 1 MiB for (two buffers)


def assign(agg, job: str, numel: int, key: str = "w", tenant: str | None = None) -> wire.Message:
    fields = {"tenant": tenant} if tenant else {}
    agg.assignments.assign(wire.decode(wire.encode(wire.ASSIGN, req=1, job=job, secret="s" * 16, world_size=1,
                                                   mode="sum", keys=[spec(key, numel)], **fields)))
    return agg.answers.pop()


def test_declarations_of_a_tenant_named_by_pmaster_are_held_to_its_quota(agg):
    assert assign(agg, "a1", 2 * HALF, tenant="alice").op == wire.OK            # 2 MiB ...
    assert assign(agg, "a1", 6 * HALF, key="v", tenant="alice").op == wire.OK   # ... + 6 MiB
    refused = assign(agg, "a2", 5 * HALF, tenant="alice")                       # 5 MiB more: past 12 MiB
    assert refused.op == wire.ERROR and "(--max-tenant-bytes)" in refused["message"], refused.fields
    assert "a2" not in agg.store.jobs and agg.commitments.committed == {"a1": 8 * M}
    assert assign(agg, "a2", 4 * HALF, tenant="alice").op == wire.OK            # 4 MiB: the quota exactly
    assert assign(agg, "b1", 8 * HALF, tenant="bob").op == wire.OK              # another tenant
    assert assign(agg, "m1", 10 * HALF, tenant=quota.MEMBER).op == wire.OK      # the services' key
    assert "(--max-job-bytes)" in assign(agg, "m1", 1, key="v", tenant=quota.MEMBER)["message"]
    assert agg.stats["memory_refusals"] == 2
    agg._release("a1")
    assert "a1" not in agg.commitments.committed and "a1" not in agg.commitments.tenants
    assert assign(agg, "a3", 8 * HALF, tenant="alice").op == wire.OK            # room again


class Frame:
    """A received message's header as a CURVE listener gives it: it names the client's key."""

    def __init__(self, user: str) -> None:
        self.user = user

    def get(self, name: str) -> str:
        assert name == "User-Id"
        return self.user


def request(job: str, secret: str = "s" * 16) -> wire.Message:
    return wire.decode(wire.encode(wire.PULL, req=2, job=job, secret=secret, rank=0, items=[]))


def test_a_jobs_tenant_learnt_from_its_first_request_past_the_quota_drops_the_job_here(agg):
    assert assign(agg, "a1", 8 * HALF).op == wire.OK                # 8 MiB, tenant not known yet
    agg._check_tenant(request("a1"), Frame("alice"), keyed=True)
    assert agg.commitments.tenants == {"a1": "alice"}
    assert assign(agg, "a2", 6 * HALF).op == wire.OK                # 6 MiB: the per-job cap only, so far
    with pytest.raises(SecretMismatch):
        agg._check_tenant(request("a2", secret="t" * 16), Frame("alice"), keyed=True)
    assert "a2" not in agg.commitments.tenants                                   # a wrong secret names no tenant
    from autops.aggregator.service import NoRoom
    with pytest.raises(NoRoom, match=r"job 'a2' of tenant 'alice'.*\(--max-tenant-bytes\)"):
        agg._check_tenant(request("a2"), Frame("alice"), keyed=True)
    assert "a2" not in agg.store.jobs and agg.commitments.committed == {"a1": 8 * M}    # its memory is freed
    with pytest.raises(NoRoom, match="--max-tenant-bytes"):          # and later requests are told why
        agg._check_tenant(request("a2"), Frame("alice"), keyed=False)
    assert assign(agg, "m1", 8 * HALF).op == wire.OK
    agg._check_tenant(request("m1"), Frame(quota.MEMBER), keyed=True)      # the services' key: no quota
    assert agg.commitments.tenants["m1"] == quota.MEMBER and "m1" in agg.store.jobs
    agg._check_tenant(request("a1"), Frame("bob"), keyed=True)
    assert agg.commitments.tenants["a1"] == "alice"                              # the first key named it


def prepare(agg, job: str, numel: int, key: str = "w", mid: int = 1) -> wire.Message:
    agg.moves_in.prepare(wire.decode(wire.encode(
        wire.MIGRATE_PREPARE, req=3, mid=mid, job=job, secret="s" * 16, world_size=1, mode="server",
        optimizer="sgd", hp={"lr": 0.1, "momentum": 0.9}, average=True, keys=[spec(key, numel)], replicas={})))
    return agg.answers.pop()


def test_keys_moving_in_are_committed_refused_past_the_limit_and_released_as_they_leave(agg):
    quarter = M // 4             # server mode, SGD with momentum: master copy, accumulator, momentum
    refused = prepare(agg, "j", 4 * quarter)                        # 3 MiB ... x 4 = 12 MiB > 10 MiB
    assert refused.op == wire.ERROR and "limit of 10485760 bytes per job (--max-job-bytes)" in refused["message"]
    assert "j" not in agg.store.jobs and agg.commitments.committed == {} and agg.commitments.pending == {}
    assert prepare(agg, "j", 3 * quarter).op == wire.OK             # 3 x 3 MiB = 9 MiB
    assert agg.store.jobs["j"].keys["w"].arrival == Arrival(1) and agg.commitments.committed == {"j": 9 * M}
    assert prepare(agg, "j", quarter, key="v", mid=2).op == wire.ERROR   # 3 MiB more: past 10 MiB
    # the key moves away again: its master copy stays as the job's spare, the rest is released
    agg.moves_in.drop(wire.decode(wire.encode(wire.MIGRATE_DROP, job="j", keys=["w"])))
    assert agg.commitments.committed == {"j": 3 * M}
    assert prepare(agg, "j", 3 * quarter, mid=3).op == wire.OK      # back: the spare reused, 6 MiB new
    assert agg.commitments.committed == {"j": 9 * M}
    agg._release("j")
    assert agg.commitments.committed == {} and agg.commitments.pending == {}


def test_a_new_backup_past_the_limit_is_refused_and_its_owner_goes_on_without_it(agg):
    import numpy as np

    from autops.aggregator.service import NoRoom
    from autops.aggregator.store import Store

    quarter = M // 4
    owner_store = Store()
    owner_store.assign("j", "s" * 16, 1, "server", [KeySpec("w", "w", 0, 5 * quarter, "float32", False)],
                       optimizer="sgd", hp={"lr": 0.1, "momentum": 0.9})
    ks = owner_store.jobs["j"].keys["w"]
    owner_store.init(owner_store.jobs["j"], "w", np.zeros(ks.spec.numel, np.float32))
    meta, arrays = Store.export_key(ks)
    meta.update(spec=ks.spec.to_wire(), mode="server", average=True, world_size=1, optimizer="sgd")
    msg = wire.decode(wire.encode(wire.REPLICATE, [np.array(a) for a in arrays], req=4, kind="state", job="j",
                                  secret="s" * 16, items=[wire.KeyCopy("w", meta, len(arrays)).to_wire()]))
    assert assign(agg, "j", 2 * HALF, key="v").op == wire.OK        # 2 MiB held; the backup: 10 MiB more
    with pytest.raises(NoRoom, match="--max-job-bytes"):
        agg.replication.receive(None, msg)
    assert "w" not in agg.store.jobs["j"].replicas and agg.commitments.committed == {"j": 2 * M}
    # the owner's side: told no_room, it stops replicating instead of sending the state again
    ks.replica = {"agg": "agg-9"}
    agg.replication.waits[7] = (ks, 0, "agg-9")
    agg.replication.acked(wire.decode(wire.error("no room", req=7, no_room=True)))
    assert ks.replica is None and ks.published == ks.completed


# --- one connection cap for the process's listeners -------------------------------------------
def raw(address: str) -> socket.socket:
    if address.startswith("ipc://"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(address[len("ipc://"):])
    else:
        host, port = address[len("tcp://"):].rsplit(":", 1)
        s = socket.create_connection((host, int(port)))
    s.settimeout(0.5)
    return s


def closed(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except socket.timeout:
        return False
    except OSError:
        return True


def test_listeners_sharing_a_budget_hold_its_cap_together_and_keep_job_channels(tmp_path):
    budget = LinkBudget(4)
    tcp = StreamListener("tcp://127.0.0.1:0", handshake_s=30, idle_s=60, budget=budget)
    ipc = StreamListener(f"ipc://{tmp_path}/agg.sock", handshake_s=30, idle_s=60, budget=budget)
    job = StreamChannel(ipc.address)
    idle = []
    try:
        job.send(b"a job's request")
        deadline = time.monotonic() + 5
        while (got := ipc.recv()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        got.reply.vouch()
        for i in range(8):                      # alternately on both endpoints, each accepted in turn
            listener = tcp if i % 2 == 0 else ipc
            accepted = len(listener.links) + listener.limit_counts["evicted"]
            idle.append(raw(listener.address))
            deadline = time.monotonic() + 5
            while len(listener.links) + listener.limit_counts["evicted"] == accepted and time.monotonic() < deadline:
                listener.recv()
            assert budget.held() <= 4
        assert len(tcp.links) + len(ipc.links) == 4 == budget.held()
        assert tcp.limit_counts["evicted"] + ipc.limit_counts["evicted"] == 5
        assert [closed(s) for s in idle] == [True] * 5 + [False] * 3      # the oldest, on either endpoint
        job.send(b"served")
        deadline = time.monotonic() + 5
        while (got := ipc.recv()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert bytes(got.header) == b"served"
        for listener in (tcp, ipc):
            for link in list(listener.links.values()):
                listener.vouch(link)            # every one a job's channel: a new one is refused
        extra = raw(tcp.address)
        time.sleep(0.05)
        tcp.recv()
        extra.settimeout(2)
        assert closed(extra) and tcp.limit_counts["refused_over_cap"] == 1 and budget.held() == 4
        extra.close()
    finally:
        for s in idle:
            s.close()
        job.close()
        tcp.close()
        ipc.close()
    assert budget.listeners == []
