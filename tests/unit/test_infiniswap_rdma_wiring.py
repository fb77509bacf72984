"""Infiniswap's RDMA wiring without hardware (docs/rdma.md): the protocol fields (MR_INFO's
address and rkey, RDMA_CONNECT / RDMA_ACCEPT's queue-pair addresses) round trip and are
validated; the device core's RDMA remote on the core's fake fabric (READ/WRITE are memcpys
checked against the registration tables as a NIC checks them); the daemon's lending
(``infiniswap.rdmalend``): a slab registered when lent, deregistered before it is taken
back; and a wrong or withdrawn rkey killing the remote while every read stays right."""
from __future__ import annotations

import mmap
import struct

import numpy as np
import pytest
import zmq
from hypothesis import given, settings, strategies as st

from dlrt.keys import ensure_cluster_secret
from infiniswap import protocol as p
from infiniswap import rdma
from infiniswap.channel import context
from infiniswap.core import CoreDevice, SlabState, SlabStore
from infiniswap.ctlauth import device_proof
from infiniswap.daemon import Daemon
from infiniswap.rdmalend import RdmaLending

MiB = 1 << 20
PAGE = 4096


def _qp(**override):
    info = {"qpn": 0x1234, "psn": 0xABCDE, "lid": 7, "mtu": 5, "global": 1, "gid": bytes(range(16))}
    info.update(override)
    return info


def _addr(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


# ---- protocol ----

qp_infos = st.fixed_dictionaries({
    "qpn": st.integers(0, (1 << 24) - 1), "psn": st.integers(0, (1 << 24) - 1),
    "lid": st.integers(0, (1 << 16) - 1), "mtu": st.integers(1, 5), "global": st.integers(0, 1),
    "gid": st.binary(min_size=16, max_size=16)})


@settings(max_examples=50, deadline=None)
@given(qp=qp_infos, capacity=st.integers(0, 1 << 63), addr=st.integers(0, (1 << 64) - 1),
       rkey=st.integers(0, (1 << 32) - 1))
def test_rdma_fields_round_trip(qp, capacity, addr, rkey):
    for op, fields in ((p.RDMA_CONNECT, {"device_id": "dev", "qp": qp}),
                       (p.RDMA_ACCEPT, {"qp": qp, "capacity": capacity, "instance": "i"}),
                       (p.MR_INFO, {"slab": 1, "region": MiB, "size": MiB, "generation": 3,
                                    "host_id": "h", "host": "x", "data_port": None,
                                    "shm_path": None, "rdma_addr": addr, "rdma_rkey": rkey})):
        msg = p.decode(p.encode(op, id=9, **fields))
        assert msg.op == op and msg.fields == {"id": 9, **fields}


@pytest.mark.parametrize("qp", [
    _qp(qpn=1 << 24), _qp(psn=1 << 24), _qp(lid=1 << 16), _qp(mtu=0), _qp(mtu=6), _qp(**{"global": 2}),
    _qp(gid=bytes(15)), _qp(gid="0" * 16), _qp(qpn=True), _qp(qpn=-1), _qp(extra=1),
    {k: v for k, v in _qp().items() if k != "lid"}, [1, 2, 3], None,
])
def test_a_malformed_queue_pair_address_is_refused(qp):
    with pytest.raises(p.ProtocolError, match="'qp' has the wrong type: expected a queue pair address"):
        p.encode(p.RDMA_CONNECT, device_id="dev", qp=qp)
    raw = p.PROTOCOL.pack(p.RDMA_ACCEPT, {"qp": qp, "capacity": MiB})
    with pytest.raises(p.ProtocolError):
        p.decode(raw)


@pytest.mark.parametrize("fields, error", [
    ({"rdma_addr": 4096}, "come together"),
    ({"rdma_rkey": 5}, "come together"),
    ({"rdma_addr": 4096, "rdma_rkey": 1 << 32}, "below 2\\*\\*32"),
    ({"rdma_addr": -1, "rdma_rkey": 5}, "below 2\\*\\*64"),
    ({"rdma_addr": 4096, "rdma_rkey": None}, "below 2\\*\\*32"),
])
def test_mr_info_rdma_fields_are_validated(fields, error):
    base = {"slab": 1, "region": 0, "size": MiB, "generation": 1, "host_id": "h", "host": "x",
            "data_port": None, "shm_path": None}
    raw = p.PROTOCOL.pack(p.MR_INFO, {**base, **fields})
    with pytest.raises(p.ProtocolError, match=error):
        p.decode(raw)
    assert p.decode(p.encode(p.MR_INFO, **base)).get("rdma_rkey") is None    # neither: fine


def test_rdma_connect_and_accept_need_their_fields():
    with pytest.raises(p.ProtocolError, match="missing field 'qp'"):
        p.encode(p.RDMA_CONNECT, device_id="dev")
    with pytest.raises(p.ProtocolError, match="missing field 'capacity'"):
        p.encode(p.RDMA_ACCEPT, qp=_qp())


# ---- the core's RDMA remote on the fake fabric ----

class _Lent:
    """A daemon's side in miniature: a slab of memory registered on its own fake device and a
    queue pair the device's one is connected to."""

    def __init__(self, nslabs: int = 2) -> None:
        self.verbs = rdma.RdmaDevice(fake=True)
        self.memory = np.zeros(nslabs * MiB, np.uint8)
        self.keys = [self.verbs.register(_addr(self.memory) + i * MiB, MiB)[1] for i in range(nslabs)]
        self.qp = self.verbs.queue_pair()

    def addr(self, slot: int) -> int:
        return _addr(self.memory) + slot * MiB

    def close(self) -> None:
        self.qp.close()
        self.verbs.close()


@pytest.fixture
def wired(tmp_path):
    """A device core with an RDMA remote over the fake fabric to a ``_Lent`` daemon side."""
    lent = _Lent()
    mine = rdma.RdmaDevice(fake=True)
    core = CoreDevice(4 * MiB, MiB, tmp_path / "backup", 2)
    qp = mine.queue_pair()
    qp.connect(lent.qp.info)
    lent.qp.connect(qp.info)
    rid = core.add_remote_rdma(qp, 2)
    with pytest.raises(ValueError, match="handed over"):
        qp.connect(lent.qp.info)                                 # the remote owns it now
    yield core, rid, lent
    core.close()
    mine.close()
    lent.close()


def _map(core: CoreDevice, rid: int, slab: int, slot: int, lent: _Lent, gen: int = 1,
         rkey: int | None = None) -> None:
    core.begin_map(slab)
    core.set_rdma_slab(rid, slot * MiB, gen, lent.addr(slot), lent.keys[slot] if rkey is None else rkey)
    core.map_slab(slab, rid, slot * MiB, gen)


def test_pages_go_to_the_lent_memory_and_come_back_one_sidedly(wired):
    core, rid, lent = wired
    _map(core, rid, 0, 1, lent)
    data = np.random.default_rng(1).integers(0, 256, 3 * PAGE, np.uint8).tobytes()
    core.write(2 * PAGE, data)
    assert lent.memory[MiB + 2 * PAGE:MiB + 5 * PAGE].tobytes() == data     # slot 1, by WRITE
    lent.memory[MiB + 2 * PAGE] ^= 0xFF                                     # the READ sees it
    got = core.read(2 * PAGE, 3 * PAGE)
    assert got[1:] == data[1:] and got[0] == data[0] ^ 0xFF
    info = core.slab_info(0)
    assert info.bytes_written_remote == 3 * PAGE and info.bytes_read_remote == 3 * PAGE
    assert not core.remote_dead(rid)


def test_a_wrong_rkey_kills_the_remote_and_reads_stay_right(wired):
    core, rid, lent = wired
    _map(core, rid, 0, 0, lent, rkey=lent.keys[1])          # slot 1's key does not open slot 0
    data = b"\x5a" * PAGE
    core.write(0, data)                                     # the WRITE fails: to disk at once
    assert core.remote_dead(rid)
    assert "remote access error" in core.remote_error(rid)
    assert core.read(0, PAGE) == data
    assert not lent.memory[:PAGE].any()                     # the NIC never wrote there
    assert core.failed_slabs() == [0]


def test_a_deregistered_slab_fails_the_next_access_and_the_data_stays_right(wired):
    core, rid, lent = wired
    _map(core, rid, 0, 0, lent)
    data = np.random.default_rng(2).integers(0, 256, 2 * PAGE, np.uint8).tobytes()
    core.write(0, data)
    core.flush()
    lent.verbs.deregister(lent.addr(0), MiB)                # the daemon takes the slab back
    lent.memory[:2 * PAGE] = 0                              # ... and lends it to someone else
    assert core.read(0, 2 * PAGE) == data                   # from the backup file
    assert core.remote_dead(rid) and "remote access error" in core.remote_error(rid)
    assert core.slab_info(0).state == SlabState.EVICTING


def test_a_stale_generation_fails_the_slab_but_not_the_remote(wired):
    core, rid, lent = wired
    _map(core, rid, 0, 0, lent, gen=4)
    core.set_rdma_slab(rid, 0, 5, lent.addr(0), lent.keys[0])   # the daemon lent it again
    core.write(0, b"\x01" * PAGE)
    assert core.failed_slabs() == [0] and not core.remote_dead(rid)
    assert core.read(0, PAGE) == b"\x01" * PAGE
    assert not lent.memory[:PAGE].any()


def test_slab_leases_are_checked(wired):
    core, rid, lent = wired
    with pytest.raises(ValueError, match="not slab aligned"):
        core.set_rdma_slab(rid, PAGE, 1, lent.addr(0), lent.keys[0])
    with pytest.raises((OSError, ValueError), match="outside the 2 slots"):
        core.set_rdma_slab(rid, 2 * MiB, 1, lent.addr(0), lent.keys[0])
    with pytest.raises((OSError, ValueError), match="no remote with id"):
        core.set_rdma_slab(rid + 1, 0, 1, lent.addr(0), lent.keys[0])
    with SlabStore(MiB, MiB, lock=False) as store:
        shm = core.add_remote_shm(store.path())
        with pytest.raises(ValueError, match="not an RDMA remote"):
            core.set_rdma_slab(shm, 0, 1, lent.addr(0), lent.keys[0])
        core.remove_remote(shm)
    with pytest.raises((OSError, ValueError), match="outside"):
        _map(core, rid, 0, 3, lent, rkey=1)                 # slot 3 of a 2-slot remote


def test_a_peer_queue_pair_that_is_gone_kills_the_remote(wired):
    core, rid, lent = wired
    _map(core, rid, 0, 0, lent)
    lent.qp.close()                                         # the daemon dropped this device
    core.write(0, b"\x07" * PAGE)
    assert core.remote_dead(rid) and "retry counter exceeded" in core.remote_error(rid)
    assert core.read(0, PAGE) == b"\x07" * PAGE


def test_the_loopback_selftest_passes_on_the_fake_fabric():
    with rdma.RdmaDevice(fake=True) as dev:
        dev.selftest(256 << 10)
        assert dev.regions == 0


# ---- the daemon's lending ----

class _Store:
    def __init__(self) -> None:
        self.memory = np.zeros(4 * MiB, np.uint8)

    def slab_address(self, region: int) -> int:
        return _addr(self.memory) + region


def test_lending_registers_once_per_lease_and_deregisters_on_take_back():
    store = _Store()
    with rdma.RdmaDevice(fake=True) as verbs:
        lending = RdmaLending(verbs, store, MiB)
        first = lending.lend(MiB)
        assert first["rdma_addr"] == store.slab_address(MiB)
        assert verbs.lookup(first["rdma_addr"], MiB, writable=True)[1] == first["rdma_rkey"]
        assert lending.lend(MiB) == first and verbs.regions == 1     # a retried MAP
        second = lending.lend(2 * MiB)
        assert lending.registered == 2 and second["rdma_rkey"] != first["rdma_rkey"]
        lending.take_back(MiB)
        assert verbs.lookup(first["rdma_addr"], MiB) is None and verbs.regions == 1
        lending.take_back(MiB)                                        # not lent: nothing
        again = lending.lend(MiB)
        assert again["rdma_rkey"] not in (first["rdma_rkey"], second["rdma_rkey"])   # a new lease
        lending.close()
        assert verbs.regions == 0 and lending.registered == 0


def test_lending_keeps_one_queue_pair_per_device():
    with rdma.RdmaDevice(fake=True) as verbs, rdma.RdmaDevice(fake=True) as device_side:
        lending = RdmaLending(verbs, _Store(), MiB)
        a, b = device_side.queue_pair(), device_side.queue_pair()
        first = lending.accept(b"dev", a.info)
        again = lending.accept(b"dev", b.info)                       # connects again: replaced
        assert first["qpn"] != again["qpn"] and lending.connected == 1
        lending.accept(b"other", a.info)
        assert lending.connected == 2
        with pytest.raises(OSError, match="refused"):
            lending.accept(b"bad", {**a.info, "qpn": 0})
        assert lending.connected == 2
        lending.peer_gone(b"dev")
        lending.peer_gone(b"dev")
        assert lending.connected == 1
        lending.close()
        assert lending.connected == 0
        a.close()
        b.close()


class _RecordingVerbs(rdma.RdmaDevice):
    """A fake device that notes, at each deregistration, the generation in the slab's fence
    line (the daemon's memory as a device on its host maps it): still the lease's one when
    the region is deregistered before the slab is revoked."""

    def __init__(self) -> None:
        super().__init__(fake=True)
        self.view: tuple[mmap.mmap, int, int] | None = None      # memory, capacity, base address
        self.deregistered: list[tuple[int, int]] = []             # (region, generation then)

    def deregister(self, addr: int, nbytes: int) -> None:
        if self.view is not None:
            mem, capacity, base = self.view
            region = addr - base
            generation = struct.unpack_from("<Q", mem, capacity + region // MiB * 64)[0]
            self.deregistered.append((region, generation))
        super().deregister(addr, nbytes)


def _fence_view(shm_path: str) -> tuple[mmap.mmap, int]:
    with open(shm_path, "r+b") as fh:
        mem = mmap.mmap(fh.fileno(), 0)
    return mem, struct.unpack_from("<Q", mem, len(mem) - 64 + 16)[0]


def _proof(sock: zmq.Socket, identity: bytes) -> dict:
    """The ``proof`` a raw device (routing id ``identity``) puts in MAP / RDMA_CONNECT: the
    answer to the daemon's challenge (``infiniswap.ctlauth``)."""
    pong = _ask(sock, p.PING, id=900)
    return {"proof": device_proof(ensure_cluster_secret(), pong["challenge"], identity)}


def _ask(sock: zmq.Socket, op: str, **fields) -> p.Message:
    sock.send(p.encode(op, **fields))
    assert sock.poll(5000), f"no answer to {op}"
    return p.decode(sock.recv())


def test_the_daemon_registers_a_slab_on_map_and_deregisters_it_before_taking_it_back():
    used = [0]
    verbs = _RecordingVerbs()
    daemon = Daemon(headroom=2 * MiB, slab_size=MiB, capacity=3 * MiB, total_memory=8 * MiB,
                    memory_reader=lambda: used[0], period=0.02, timeout=2.0, lock=False,
                    data_host=None, rdma=verbs).start()
    sock = context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"raw")
    sock.connect(daemon.address)
    try:
        proof = _proof(sock, b"raw")
        leases = [_ask(sock, p.MAP, id=s, device_id="raw", slab=s, slab_size=MiB, **proof)
                  for s in range(2)]
        assert [m.op for m in leases] == [p.MR_INFO, p.MR_INFO]
        mem, capacity = _fence_view(leases[0]["shm_path"])
        verbs.view = (mem, capacity, leases[0]["rdma_addr"] - leases[0]["region"])
        for info in leases:                       # registered: this address, this rkey, writable
            assert verbs.lookup(info["rdma_addr"], MiB, writable=True)[1] == info["rdma_rkey"]
        assert verbs.regions == 2
        assert _ask(sock, p.MAP, id=5, device_id="raw", slab=0, slab_size=MiB).fields == \
            {**leases[0].fields, "id": 5}                                 # retried: same lease
        assert daemon.stats()["rdma"] == {"slabs_registered": 2, "devices_connected": 0}

        # the device gives slab 0 back (UNMAP): deregistered before the generation moves
        assert _ask(sock, p.UNMAP, id=6, device_id="raw", slabs=[0]).op == p.DONE
        assert verbs.deregistered == [(leases[0]["region"], leases[0]["generation"])]
        assert verbs.lookup(leases[0]["rdma_addr"], MiB) is None and verbs.regions == 1

        # memory pressure: the daemon evicts slab 1 (CHECK_ACTIVITY, EVICT, our DONE)
        used[0] = 7 * MiB
        while True:
            assert sock.poll(5000), "no eviction"
            msg = p.decode(sock.recv())
            if msg.op == p.CHECK_ACTIVITY:
                sock.send(p.reply_to(msg, p.ACTIVITY, activity={s: 0.0 for s in msg["slabs"]}))
            elif msg.op == p.EVICT:
                assert msg["slabs"] == [1]
                assert verbs.regions == 1                 # still lent until the device is done
                sock.send(p.reply_to(msg, p.DONE, slabs=msg["slabs"]))
                break
        assert _ask(sock, p.PING, id=7).op == p.PONG      # the DONE was handled
        assert verbs.deregistered[1] == (leases[1]["region"], leases[1]["generation"])
        assert verbs.regions == 0
    finally:
        sock.close(0)
        daemon.stop()
        verbs.close()


def test_a_daemon_without_rdma_refuses_rdma_connect_and_sends_no_rkey():
    with Daemon(headroom=0, slab_size=MiB, capacity=2 * MiB, total_memory=8 * MiB,
                memory_reader=lambda: 0, period=0.05, lock=False, data_host=None) as daemon:
        sock = context().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, b"raw")
        sock.connect(daemon.address)
        try:
            refused = _ask(sock, p.RDMA_CONNECT, id=1, device_id="raw", qp=_qp())
            assert refused.op == p.ERROR and refused["code"] == "no_rdma"
            info = _ask(sock, p.MAP, id=2, device_id="raw", slab=0, slab_size=MiB,
                        **_proof(sock, b"raw"))
            assert info.op == p.MR_INFO and info.get("rdma_rkey") is None
            assert daemon.stats()["rdma"] is None
        finally:
            sock.close(0)


def test_rdma_connect_gets_a_connected_queue_pair():
    with rdma.RdmaDevice(fake=True) as verbs, rdma.RdmaDevice(fake=True) as device_side, \
            Daemon(headroom=0, slab_size=MiB, capacity=2 * MiB, total_memory=8 * MiB,
                   memory_reader=lambda: 0, period=0.05, lock=False, data_host=None, rdma=verbs) as daemon:
        sock = context().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, b"raw")
        sock.connect(daemon.address)
        qp = device_side.queue_pair()
        try:
            accepted = _ask(sock, p.RDMA_CONNECT, id=1, device_id="raw", qp=qp.info,
                            **_proof(sock, b"raw"))
            assert accepted.op == p.RDMA_ACCEPT and accepted["capacity"] == 2 * MiB
            assert accepted["instance"] == daemon.instance and accepted["qp"]["qpn"] != qp.info["qpn"]
            bad = _ask(sock, p.RDMA_CONNECT, id=2, device_id="raw", qp={**qp.info, "qpn": 0})
            assert bad.op == p.ERROR and bad["code"] == "rdma"
            assert daemon.stats()["rdma"]["devices_connected"] == 1
        finally:
            qp.close()
            sock.close(0)


def test_a_real_device_is_used_only_where_there_is_one():
    if rdma.device_count() == 0:
        print("no RDMA device (ibv_get_device_list returned none): the hardware path is not tried")
        pytest.skip("no RDMA device")
    with rdma.RdmaDevice() as dev:                     # where there is one: the loopback first
        dev.selftest(1 << 20)
