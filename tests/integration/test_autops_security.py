"""Attackers against a live AutoPS pool with CURVE on (its own key directory, tcp on 127.0.0.1).

A victim job (W=2, sum mode) trains a few iterations while, between its iterations, each
attacker tries its way in: registering as the victim's unjoined rank without its secret or
with another job's, pushing into its keys with the wrong secret, an aggregator without the
cluster key, an operator command without the token, CURVE clients with a key that is not
authorized, a wrong server key or no CURVE at all, and a replayed and a truncated CURVE
handshake on a raw TCP socket. Each is refused, the refusal is counted (pMaster's status,
``security.refusals``), and the victim's result is bit-identical to a run without them. Then a
pMaster restart: the victim's job id cannot be claimed with another secret.
"""
from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
import zmq
import zmq.auth

from autops.wire import clusterauth, protocol as wire
from autops.admin import AdminClient
from autops.worker.agent import Agent, AuthRefused, AutoPSError, MasterClient, MasterUnreachable
from autops.aggregator.service import Aggregator
from autops.wire.jobauth import new_job_secret
from autops.local import LocalPool
from autops.transport import make_context
from dlrt.curve import Security
from dlrt.keys import Keys, init_keys

W = 2
ITERS = 4
TENSORS = [("w", (40_000,), "float32"), ("b", (10,), "float32")]


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return init_keys(tmp_path_factory.mktemp("cluster-keys"))


@pytest.fixture(scope="module")
def pool(keys):
    with LocalPool(2, env={"DLRT_KEYS": str(keys)}, master_args=["--static"]) as pool:
        assert pool.security.curve
        yield pool


def grad(rank: int, it: int, name: str, shape) -> np.ndarray:
    rng = np.random.default_rng([rank, it, sum(map(ord, name))])
    return rng.standard_normal(shape).astype(np.float32)


class Job:
    """A W=2 sum-mode job over tcp; ``step(it)`` runs one iteration on both ranks at once."""

    def __init__(self, pool: LocalPool, name: str, between_ranks=lambda: None) -> None:
        self.secret = new_job_secret()
        kw = dict(average=False, num_aggregators=0, timeout=30, transport="tcp", secret=self.secret,
                  security=pool.security)
        self.agents = [Agent(pool.master, name, 0, W, **kw)]
        between_ranks()                     # rank 1 has not joined yet
        self.agents.append(Agent(pool.master, name, 1, W, **kw))
        for a in self.agents:
            a.declare(TENSORS)
        self.params = [{n: np.linspace(-1, 1, int(np.prod(s)), dtype=np.float32).reshape(s) for n, s, _ in TENSORS}
                       for _ in range(W)]

    def step(self, it: int) -> None:
        errors: list = []

        def rank_step(rank: int) -> None:
            try:
                out = {n: np.empty(s, np.float32) for n, s, _ in TENSORS}
                for h in [self.agents[rank].push_pull(n, grad(rank, it, n, s), out[n], it) for n, s, _ in TENSORS]:
                    h.wait()
                for n, _, _ in TENSORS:
                    self.params[rank][n] -= np.float32(0.01) * out[n]
            except BaseException as exc:  # re-raised in the test thread
                errors.append(exc)

        threads = [threading.Thread(target=rank_step, args=(r,)) for r in range(W)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and not any(t.is_alive() for t in threads), errors

    def result(self) -> dict[str, bytes]:
        for n, _, _ in TENSORS:
            assert self.params[0][n].tobytes() == self.params[1][n].tobytes()
        return {n: self.params[0][n].tobytes() for n, _, _ in TENSORS}

    def close(self) -> None:
        for a in self.agents:
            a.close()


def train(pool: LocalPool, name: str, between_ranks=lambda: None, between_iterations=lambda job: None) -> dict:
    job = Job(pool, name, between_ranks)
    try:
        for it in range(1, ITERS + 1):
            job.step(it)
            if it == 2:
                between_iterations(job)
        return job.result()
    finally:
        job.close()


def refusals(pool: LocalPool) -> dict[str, int]:
    counts = pool.status()["security"]["refusals"]
    counts["curve"] = sum(n for reason, n in counts.items() if reason.startswith("curve_"))
    return counts


def wait_for_count(pool: LocalPool, reason: str, above: int, timeout: float = 15.0) -> int:
    """pMaster's count of ``reason`` once it exceeds ``above`` (CURVE refusals and the
    aggregators' own are reported asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        n = refusals(pool).get(reason, 0)
        if n > above or time.monotonic() > deadline:
            return n
        time.sleep(0.1)


def other_keys(keys, tmp_path, server_public: bytes | None = "cluster", client: str = "rogue") -> Security:
    """A ``Security`` with a fresh client key pair (not authorized) and the cluster's server
    key, another server key, or no CURVE at all (``server_public=None``)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    pub, sec = zmq.auth.load_certificate(zmq.auth.create_certificates(str(tmp_path), client)[1])
    if server_public == "cluster":
        server_public = Keys.load(keys).server_public
    return Security(Keys(tmp_path, server_public, None, pub, sec))


def push_with(pool: LocalPool, address: str, job: str, secret: str, key: str) -> wire.Message:
    """One PUSH of ``key`` for ``job`` presenting ``secret``, straight to an aggregator; its answer."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    pool.security.client(sock, address)
    sock.connect(address)
    try:
        data = np.zeros(10, np.float32)
        sock.send_multipart(wire.encode(wire.PUSH, [data], req=7, job=job, secret=secret, rank=1,
                                        items=[wire.PushItem(key, 3, wire.Slice(0, 0, data.nbytes)).to_wire()]))
        assert sock.poll(10_000), "the aggregator did not answer"
        return wire.decode(sock.recv_multipart())
    finally:
        sock.close(0)
        ctx.term()


def register_without_the_key(pool: LocalPool) -> None:
    """The registration handshake answered with a proof over another key: refused."""
    ctx = make_context()
    client = MasterClient(ctx, pool.master, 5, pool.security)
    where = dict(endpoints={"tcp": "tcp://127.0.0.1:9"}, host="rogue-host", pid=1, name="rogue")
    try:
        nonce = clusterauth.new_nonce()
        hello = client.call(wire.REGISTER_AGG, nonce=nonce, **where)
        with pytest.raises(AuthRefused, match="did not prove the cluster key"):
            client.call(wire.REGISTER_AGG, nonce=nonce, answer=clusterauth.answer(bytes(32), hello["challenge"], nonce),
                        **where)
    finally:
        client.close()
        ctx.term()


def status_with(master: str, security: Security) -> dict:
    with AdminClient(master, timeout=1.5, security=security) as admin:
        return admin.status()


# --- raw ZMTP ------------------------------------------------------------------------------------
def host_port(address: str) -> tuple[str, int]:
    host, port = address[len("tcp://"):].rsplit(":", 1)
    return host, int(port)


class Recorder:
    """A TCP relay to ``target`` that records what the client sent (one connection)."""

    def __init__(self, target: str) -> None:
        self.target = host_port(target)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.sent = bytearray()
        self.thread = threading.Thread(target=self._relay, daemon=True)
        self.thread.start()

    def _relay(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(self.target)

        def pump(src: socket.socket, dst: socket.socket, record: bool) -> None:
            try:
                while data := src.recv(65536):
                    if record:
                        self.sent.extend(data)
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        back = threading.Thread(target=pump, args=(server, client, False), daemon=True)
        back.start()
        pump(client, server, True)
        back.join(5)
        client.close()
        server.close()
        self.listener.close()


def send_raw(address: str, data: bytes) -> bytes:
    """``data`` on a fresh TCP connection; what came back until the server closed it."""
    got = bytearray()
    with socket.create_connection(host_port(address), timeout=10) as s:
        s.sendall(data)
        try:
            while chunk := s.recv(65536):
                got.extend(chunk)
        except (ConnectionResetError, socket.timeout):
            pass
    return bytes(got)


def curve_greeting() -> bytes:
    """A ZMTP 3.0 client greeting announcing CURVE."""
    return b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) + b"CURVE".ljust(20, b"\0") + b"\0" + b"\0" * 31


# --- the tests -------------------------------------------------------------------------------------
def test_attackers_are_refused_counted_and_change_nothing(pool, keys, tmp_path):
    reference = train(pool, "reference")
    before = refusals(pool)
    outsider = Job(pool, "other")          # another tenant's live job, with a secret of its own
    seen: dict = {}

    def at_unjoined_rank() -> None:
        # the victim's rank 0 is in, rank 1 is not: an attacker knowing only the job id
        with pytest.raises(AutoPSError, match="AUTOPS_JOB_SECRET"):
            Agent(pool.master, "victim", 1, W, timeout=5, security=pool.security)
        for secret, reason in [(outsider.secret, "wrong_secret"), (new_job_secret(), "wrong_secret")]:
            with pytest.raises(AuthRefused, match="pMaster refused register_job: wrong secret for job victim"):
                Agent(pool.master, "victim", 1, W, timeout=5, secret=secret, security=pool.security)
        ctx = make_context()
        client = MasterClient(ctx, pool.master, 5, pool.security)
        try:
            with pytest.raises(AuthRefused, match="no secret presented for job victim"):
                client.call(wire.REGISTER_JOB, job="victim", world_size=W, rank=1, num_aggregators=2, mode="sum")
            with pytest.raises(AuthRefused, match="wrong secret"):
                client.call(wire.GET_TABLE, job="victim", secret=outsider.secret)
        finally:
            client.close()
            ctx.term()

    def attacks(victim: Job) -> None:
        # the data path: a push into the victim's key at its aggregator, with the outsider's secret
        table = victim.agents[0].table
        key = table.by_tensor["w"][0].key
        reply = push_with(pool, table.aggs[table.owner[key]]["endpoints"]["tcp"], "victim", outsider.secret, key)
        assert reply.op == wire.ERROR and "wrong secret for job victim" in reply["message"]
        seen["agg"] = wait_for_count(pool, "aggregator_wrong_secret", before.get("aggregator_wrong_secret", 0))
        # an aggregator without the cluster key (but with a CURVE key the cluster accepts)
        rogue = Aggregator(pool.master, register_timeout=5, security=pool.security, cluster_secret=bytes(32),
                           name="rogue")
        try:     # its proof of pMaster fails, so it goes no further
            with pytest.raises(RuntimeError, match="did not prove the cluster key"):
                rogue.register()
        finally:
            rogue.close()
        register_without_the_key(pool)           # one that answers the challenge anyway is refused
        # an operator command without the operator token
        with AdminClient(pool.master, timeout=5, token="not-the-token", security=pool.security) as admin:
            with pytest.raises(AuthRefused, match="operator token"):
                admin.migrate("victim")
        # a recorded handshake replayed, and a truncated one, on raw TCP: each counted once refused
        recorder = Recorder(pool.master)
        assert status_with(recorder.address, pool.security)["master"]     # a real client, through the recorder
        recorder.thread.join(10)
        assert len(recorder.sent) > 64 + 200
        for attempt in (bytes(recorder.sent), curve_greeting() + b"\x04\x10\x05HELLO" + b"\0" * 10):
            count = refusals(pool).get("curve_bad_handshake", 0)
            send_raw(pool.master, attempt)
            assert wait_for_count(pool, "curve_bad_handshake", count) > count
        # CURVE: a key that is not authorized, a wrong server key, plaintext: no answer at all
        for reason, security in [
                ("curve_not_authorized", other_keys(keys, tmp_path / "k1")),
                ("curve_bad_handshake", other_keys(keys, tmp_path / "k2", server_public=zmq.curve_keypair()[0])),
                # plaintext: refused as a mechanism mismatch, or as a broken handshake when the client
                # gives up first
                ("curve", other_keys(keys, tmp_path / "k3", server_public=None))]:
            count = refusals(pool).get(reason, 0)
            with pytest.raises(MasterUnreachable):
                status_with(pool.master, security)
            assert wait_for_count(pool, reason, count) > count, (reason, security.keys.server_public)

    victim = train(pool, "victim", between_ranks=at_unjoined_rank, between_iterations=attacks)
    outsider.close()
    assert victim == reference

    after = refusals(pool)
    gained = {reason: after.get(reason, 0) - before.get(reason, 0) for reason in after}
    assert gained["wrong_secret"] >= 3 and gained["no_secret"] >= 1
    assert gained["cluster_key"] == 1 and gained["operator_token"] == 1
    assert seen["agg"] > before.get("aggregator_wrong_secret", 0)
    assert gained["curve_not_authorized"] >= 1 and gained["curve_bad_handshake"] >= 3 and gained["curve"] >= 5


def test_after_a_pmaster_restart_nobody_claims_a_running_jobs_id(tmp_path):
    with LocalPool(1, master_args=["--static"]) as pool:
        secret = new_job_secret()
        agent = Agent(pool.master, "survivor", 0, 1, average=False, timeout=30, secret=secret)
        try:
            agent.declare([("w", (100,), "float32")])
            out = np.empty(100, np.float32)
            agent.push_pull("w", np.ones(100, np.float32), out, 1).wait()
            pool.kill_master()
            pool.start_master()
            deadline = time.monotonic() + 20
            while True:     # pMaster is back (its aggregator may not be yet)
                try:
                    pool.status()
                    break
                except AutoPSError:
                    assert time.monotonic() < deadline, "pMaster did not come back"
            with pytest.raises(AuthRefused, match="wrong secret for job survivor"):
                Agent(pool.master, "survivor", 0, 1, timeout=10, secret=new_job_secret())
            assert pool.status()["security"]["refusals"].get("wrong_secret") == 1
            agent.push_pull("w", np.ones(100, np.float32), out, 2).wait(60)     # the job itself goes on
            np.testing.assert_array_equal(out, np.ones(100, np.float32))
        finally:
            agent.close()
