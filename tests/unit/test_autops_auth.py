"""AutoPS authentication logic without a pool: job secrets and their persisted hashes, the
cluster-key handshake and sealed control channel, the aggregators' peer tickets, and pMaster's
refusals (driven through its dispatch with a socket that records what it would send)."""
from __future__ import annotations

import stat

import pytest

from autops.wire import clusterauth, protocol as wire
from autops.wire.jobauth import JobSecrets, SecretRefused, check_secret_shape, new_job_secret
from autops.master.pmaster import Master
from autops.master.report import metric_samples
from dlrt.curve import Security
from dlrt.keys import Keys

CLUSTER = bytes(range(32))
TOKEN = "operator-token-for-the-tests"


# --- job secrets ---------------------------------------------------------------------------
def test_a_job_secret_is_recorded_salted_and_persists_across_instances(tmp_path):
    secret = new_job_secret()
    first = JobSecrets(tmp_path / "state")
    first.claim("job-a", secret)
    first.claim("job-a", secret)                   # the same secret again: fine
    with pytest.raises(SecretRefused) as refused:
        first.claim("job-a", new_job_secret())
    assert refused.value.reason == "wrong_secret"
    first.close()
    db = tmp_path / "state" / "jobs.sqlite"
    assert stat.S_IMODE(db.stat().st_mode) == 0o600 and stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o700
    assert secret.encode() not in db.read_bytes()  # a hash, never the secret
    again = JobSecrets(tmp_path / "state")         # a restarted pMaster
    assert again.jobs() == ["job-a"]
    assert again.matches("job-a", secret) is True and again.matches("job-a", "x" * 64) is False
    assert again.matches("job-b", secret) is None
    again.forget("job-a")
    again.claim("job-a", new_job_secret())         # released: the id is free again
    again.close()


@pytest.mark.parametrize("secret, reason", [(None, "no_secret"), ("", "no_secret"), (7, "no_secret"),
                                            ("short", "weak_secret")])
def test_missing_or_weak_secrets_are_refused_naming_the_variable(secret, reason):
    with pytest.raises(SecretRefused, match="AUTOPS_JOB_SECRET|autops secret") as refused:
        check_secret_shape("j", secret)
    assert refused.value.reason == reason


def test_fresh_secrets_differ_and_are_long():
    a, b = new_job_secret(), new_job_secret()
    assert a != b and len(a) == 64


# --- the cluster-key handshake ----------------------------------------------------------------
def handshake(agg_key: bytes, master_key: bytes):
    """Both sides of one registration; returns (master's proof checked by the aggregator,
    master's session or None, aggregator's session)."""
    master = clusterauth.MasterHandshake(master_key)
    nonce = clusterauth.new_nonce()
    hello = master.challenge(b"id-1", nonce)
    trusted = clusterauth.verify_master(agg_key, nonce, hello["challenge"], hello["proof"])
    answer = clusterauth.answer(agg_key, hello["challenge"], nonce)
    session = master.finish(b"id-1", nonce, answer)
    mine = clusterauth.ControlSession.for_aggregator(clusterauth.session_key(agg_key, nonce, hello["challenge"]))
    return trusted, session, mine, (master, nonce, answer)


def test_both_sides_prove_the_cluster_key_and_share_a_session():
    trusted, session, mine, _ = handshake(CLUSTER, CLUSTER)
    assert trusted and session is not None
    header = wire.encode(wire.ASSIGN, job="j", secret="s", world_size=1, mode="sum", keys=[])
    assert mine.open(session.seal(header)) == header
    up = wire.encode(wire.HEARTBEAT, agg="agg-0")
    assert session.open(mine.seal(up)) == up


def test_a_wrong_cluster_key_fails_on_either_side():
    trusted, session, _, _ = handshake(bytes(32), CLUSTER)      # aggregator without the key
    assert session is None and not trusted                      # ... and it distrusts the master too
    trusted, session, _, _ = handshake(CLUSTER, bytes(32))      # an impostor at pMaster's address
    assert not trusted and session is None


def test_a_challenge_is_answered_once_and_only_by_the_peer_it_was_issued_to():
    trusted, session, _, (master, nonce, answer) = handshake(CLUSTER, CLUSTER)
    assert session is not None
    assert master.finish(b"id-1", nonce, answer) is None         # replayed answer
    hello = master.challenge(b"id-1", nonce)
    assert master.finish(b"id-2", nonce, clusterauth.answer(CLUSTER, hello["challenge"], nonce)) is None
    with pytest.raises(ValueError, match="nonce"):
        master.challenge(b"id-3", b"short")


def test_sealed_messages_refuse_tampering_replay_reflection_and_no_seal():
    _, session, mine, _ = handshake(CLUSTER, CLUSTER)
    sealed = session.seal(wire.encode(wire.RELEASE_JOB, job="victim"))
    assert mine.open([sealed[0], sealed[1][:-1] + bytes([sealed[1][-1] ^ 1])]) is None    # tampered seal
    assert mine.open([wire.encode(wire.RELEASE_JOB, job="other")[0], sealed[1]]) is None  # other header
    assert mine.open(sealed) is not None
    assert mine.open(sealed) is None                                                      # replayed
    assert mine.open(wire.encode(wire.RELEASE_JOB, job="victim")) is None                # unsealed
    own = mine.seal(wire.encode(wire.OK))
    assert mine.open(own) is None                         # reflected: its own message sent back


def test_peer_tickets_bind_the_cluster_key_to_one_job_and_secret():
    ticket = clusterauth.peer_ticket(CLUSTER, "j", "s" * 32)
    assert clusterauth.check_peer_ticket(CLUSTER, "j", "s" * 32, ticket)
    assert not clusterauth.check_peer_ticket(CLUSTER, "k", "s" * 32, ticket)
    assert not clusterauth.check_peer_ticket(CLUSTER, "j", "t" * 32, ticket)
    assert not clusterauth.check_peer_ticket(CLUSTER, "j", "s" * 32, clusterauth.peer_ticket(bytes(32), "j", "s" * 32))
    assert not clusterauth.check_peer_ticket(CLUSTER, "j", "s" * 32, None)


# --- pMaster's refusals, through its dispatch ----------------------------------------------------
class RecordingSocket:
    """Stands in for pMaster's ROUTER: keeps what it would send, per peer identity."""

    def __init__(self) -> None:
        self.sent: list[list] = []

    def send_multipart(self, frames: list) -> None:
        self.sent.append(frames)

    def last(self, identity: bytes) -> list:
        return [f[1:] for f in self.sent if f[0] == identity][-1]

    def close(self, linger: int = 0) -> None:
        pass


@pytest.fixture
def make_master(tmp_path):
    made = []

    def make(state_dir=tmp_path / "state") -> Master:
        master = Master("tcp://127.0.0.1:0", security=Security(Keys(tmp_path, None, None, None, None)),
                        state_dir=state_dir, cluster_secret=CLUSTER, operator_token=TOKEN)
        real, master.sock = master.sock, RecordingSocket()
        made.append((master, real))
        return master

    yield make
    for master, real in made:
        real.close(0)
        master.secrets.close()
        master.ctx.term()


def ask(master: Master, identity: bytes, op: str, **fields) -> wire.Message:
    master._dispatch([identity, *wire.encode(op, req=1, **fields)])
    return wire.decode(master.sock.last(identity)[:1])


def register_agg(master: Master, identity: bytes, key: bytes = CLUSTER, name: str = "agg-0"):
    nonce = clusterauth.new_nonce()
    where = dict(endpoints={"tcp": "tcp://127.0.0.1:1"}, host="h", pid=1)
    hello = ask(master, identity, wire.REGISTER_AGG, nonce=nonce, **where)
    assert clusterauth.verify_master(CLUSTER, nonce, hello["challenge"], hello["proof"])
    reply = ask(master, identity, wire.REGISTER_AGG, nonce=nonce, name=name, **where,
                answer=clusterauth.answer(key, hello["challenge"], nonce))
    return reply, clusterauth.ControlSession.for_aggregator(clusterauth.session_key(key, nonce, hello["challenge"]))


JOB = dict(world_size=2, num_aggregators=1, mode="sum")


def test_registration_sets_the_secret_and_no_reply_carries_it(make_master):
    master = make_master()
    reply, session = register_agg(master, b"agg")
    assert reply.op == wire.OK and reply["agg"] == "agg-0"
    assert session.open(master.sock.last(b"agg")) is not None      # its reply was sealed
    secret = new_job_secret()
    reply = ask(master, b"rank0", wire.REGISTER_JOB, job="victim", rank=0, secret=secret, **JOB)
    assert reply.op == wire.OK and "secret" not in reply.fields
    assert all(secret.encode() not in bytes(f) for frames in master.sock.sent for f in frames)
    for rank, given, reason in [(1, None, "no_secret"), (1, new_job_secret(), "wrong_secret"),
                                (1, "short", "weak_secret")]:
        reply = ask(master, b"attacker", wire.REGISTER_JOB, job="victim", rank=rank, secret=given, **JOB)
        assert reply.op == wire.ERROR and reply["refused"] == reason
    assert "wrong secret for job victim" in ask(master, b"attacker", wire.REGISTER_JOB, job="victim", rank=1,
                                                secret=new_job_secret(), **JOB)["message"]
    for op, extra in [(wire.DECLARE, {"tensors": []}), (wire.GET_TABLE, {}), (wire.JOB_DONE, {"rank": 0})]:
        reply = ask(master, b"attacker", op, job="victim", secret="x" * 32, **extra)
        assert reply.op == wire.ERROR and reply["refused"] == "wrong_secret"
    assert ask(master, b"rank1", wire.REGISTER_JOB, job="victim", rank=1, secret=secret, **JOB).op == wire.OK
    refusals = master.status()["security"]["refusals"]
    assert refusals == {"no_secret": 1, "wrong_secret": 5, "weak_secret": 1}
    samples = {labels[0]: value for labels, value in metric_samples(master.status())["autops_auth_refusals_total"]}
    assert samples["wrong_secret"] == 5


def test_aggregators_must_prove_the_cluster_key_and_seal_their_reports(make_master):
    master = make_master()
    reply, _ = register_agg(master, b"rogue", key=bytes(32))
    assert reply.op == wire.ERROR and reply["refused"] == "cluster_key" and not master.state.aggs
    reply, session = register_agg(master, b"agg")
    assert reply.op == wire.OK
    # an unsealed report, or one sealed by another session, is dropped and counted
    master._dispatch([b"agg", *wire.encode(wire.TENSOR_COPY_DONE, mid=1, job="j", keys=[])])
    master._dispatch([b"agg", *wire.encode(wire.HEARTBEAT, agg="agg-0"), b"\0" * clusterauth.SEAL_BYTES])
    master._dispatch([b"other", *wire.encode(wire.OK, req=1, agg="agg-0")])
    assert master.status()["security"]["refusals"] == {"cluster_key": 1, "unsealed_control": 3}
    before = master.state.aggs["agg-0"].last_seen
    master.clock = lambda: before + 1.0
    master._dispatch([b"agg", *session.seal(wire.encode(wire.HEARTBEAT, agg="agg-0"))])
    assert master.state.aggs["agg-0"].last_seen == before + 1.0      # a sealed one is taken


def test_operator_commands_need_the_operator_token(make_master):
    master = make_master()
    for token in (None, "guess"):
        reply = ask(master, b"op", wire.MIGRATE, job="victim", token=token)
        assert reply.op == wire.ERROR and reply["refused"] == "operator_token"
    reply = ask(master, b"op", wire.MIGRATE, job="victim", token=TOKEN)
    assert reply.op == wire.ERROR and "not registered" in reply["message"]       # past the token check
    assert ask(master, b"anyone", wire.STATUS).op == wire.OK                      # status stays open


def test_a_restarted_master_refuses_a_running_jobs_id_with_another_secret(make_master, tmp_path):
    first = make_master()
    register_agg(first, b"agg")
    secret = new_job_secret()
    assert ask(first, b"r0", wire.REGISTER_JOB, job="victim", rank=0, secret=secret, **JOB).op == wire.OK
    restarted = make_master()                              # same state directory, empty pool
    register_agg(restarted, b"agg2", name="agg-1")
    reply = ask(restarted, b"thief", wire.REGISTER_JOB, job="victim", rank=0, secret=new_job_secret(), **JOB)
    assert reply.op == wire.ERROR and reply["refused"] == "wrong_secret"
    # an aggregator coming back holding the job with another secret is not believed either
    held = {"victim": {"secret": new_job_secret(), "world_size": 2, "keys": []}}
    restarted._adopt(restarted.state.aggs["agg-1"], held)
    assert "victim" not in restarted.state.jobs
    restarted._adopt(restarted.state.aggs["agg-1"], {"victim": {**held["victim"], "secret": secret}})
    assert restarted.state.jobs["victim"].secret == secret
    # once the job is released its id is free again
    restarted.release_job("victim")
    assert restarted.secrets.jobs() == []


def test_claims_of_jobs_that_never_came_back_are_dropped_after_the_grace(make_master):
    first = make_master()
    register_agg(first, b"agg")
    assert ask(first, b"r0", wire.REGISTER_JOB, job="gone", rank=0, secret=new_job_secret(), **JOB).op == wire.OK
    restarted = make_master()
    restarted._prune_claims(restarted.started + restarted.claim_grace - 0.1)
    assert restarted.secrets.jobs() == ["gone"]
    restarted._prune_claims(restarted.started + restarted.claim_grace)
    assert restarted.secrets.jobs() == []


def test_a_squatter_that_only_registers_again_and_sends_empty_profiles_loses_the_job(make_master):
    """Whoever registers a job id first owns it; one who then only repeats its registration and
    sends profile records of no new iterations, every 5 s, is released after the idle timeout
    (and the id with it), while a job whose records progress is kept."""
    master = make_master()
    now = [1000.0]
    clock = lambda: now[0]                                    # noqa: E731
    master.clock = master.state.clock = master.elastic.clock = clock
    master.started = now[0] - 60.0                            # long up: registrations again are allowed
    register_agg(master, b"agg")
    register_agg(master, b"agg2", name="agg-1")
    squat, real = new_job_secret(), new_job_secret()
    one = dict(JOB, world_size=1)
    assert ask(master, b"s0", wire.REGISTER_JOB, job="squatted", rank=0, secret=squat, **one).op == wire.OK
    assert ask(master, b"r0", wire.REGISTER_JOB, job="real", rank=0, secret=real, **one).op == wire.OK
    timeout = master.elastic.cfg.job_idle_timeout = 120.0
    for i in range(1, int(2 * timeout / 5) + 2):
        now[0] += 5.0
        for info in master.state.aggs.values():               # the aggregators heartbeat
            info.last_seen = clock()
        held = "squatted" in master.state.jobs
        again = ask(master, b"s0", wire.REGISTER_JOB, job="squatted", rank=0, secret=squat, rejoin=True, **one)
        assert (again.op == wire.OK) == held                  # once released, its id is gone for it too
        master._dispatch([b"s0", *wire.encode(wire.PROFILE, job="squatted", secret=squat, rank=0,
                                              iteration=0, count=0, duration=None)])
        master._dispatch([b"r0", *wire.encode(wire.PROFILE, job="real", secret=real, rank=0,
                                              iteration=10 * i, count=10, duration=0.1)])
        for job_id in master.elastic.expired_jobs(clock()):
            master.release_job(job_id)
        if now[0] - 1000.0 <= timeout:
            assert "squatted" in master.state.jobs
    assert "squatted" not in master.state.jobs and "real" in master.state.jobs


def test_a_pmaster_whose_start_fails_half_way_leaves_nothing_open(tmp_path):
    """No Ray cluster at --ray-address, say: the error goes up, and pMaster's socket, state
    and context are closed (its address free again), not left to the garbage collector."""
    import socket

    import zmq
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    closed = []

    class Provider:
        def close(self):
            closed.append(True)

    def no_provider(address: str):
        raise RuntimeError(f"no Ray cluster for {address}")

    kwargs = dict(security=Security(Keys(tmp_path, None, None, None, None)), state_dir=tmp_path / "state",
                  cluster_secret=CLUSTER, operator_token=TOKEN)
    with pytest.raises(RuntimeError, match=f"no Ray cluster for tcp://127.0.0.1:{port}"):
        Master(f"tcp://127.0.0.1:{port}", make_provider=no_provider, **kwargs)
    with pytest.raises((ValueError, zmq.ZMQError)):      # a bad report address, after the provider
        Master(f"tcp://127.0.0.1:{port}", provider=Provider(), report_bind="nowhere", **kwargs)
    assert closed == [True]
    master = Master(f"tcp://127.0.0.1:{port}", **kwargs)     # the address is free again
    master._release()
