"""The agent's I/O thread (``IOLoop``): it owns the ``Transport`` and its channels, a socket
to pMaster of its own, the requests in flight, the small-key batches, the staging buffers
and the pushes kept for a failure. It takes commands (``commands``) from the agent's user
threads, sends pushes and pulls, copies replies into the callers' buffers, follows key moves
and failovers, re-registers with a restarted pMaster and profiles the job's iterations.

It never sees the ``Agent``: its constructor takes the rank's settings (``LoopConfig``), the
command queue, the shared table it replaces on a redirect or failover (``SharedTable``), the
counters it keeps (``Counters``) and what the rank registered and declared (``Registration``).
"""
from __future__ import annotations

import collections
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np
import zmq

from ..wire import protocol as wire
from ..wire.partition import KeySpec
from ..transport import Channel, Inbound, Shared, Transport, TransportError
from .coalesce import Coalescer
from .commands import (BcastCmd, Command, CommandQueue, FlushCmd, InitCmd, PullCmd, PushCmd, StateCmd,
                       StopCmd, TableCmd)
from .errors import AutoPSError, MasterUnreachable, as_autops_error
from .handles import BackgroundHandle, Part, StateHandle, fail_pending
from .masterclient import MasterClient
from .shared import Counters, LoopConfig, Registration
from .table import SharedTable, Table

log = logging.getLogger("autops.worker.agent")     # the agent's log, as before the loop had a module

# seconds between the PROFILE records sent to pMaster (fixed: pMaster's profiling windows
# count iterations, not records, and a record is also the worker's sign of life)
PROFILE_PERIOD = 1.0
# a request unanswered this long makes the agent ask pMaster whether an aggregator was lost
# (fixed: the answer is a few bytes unless the job's epoch changed)
PROBE_AFTER = 1.0


@dataclass
class Request:
    kind: str
    agg: str
    parts: list
    deadline: float
    sent: float = 0.0
    resend: tuple | None = None        # (op, payloads, fields) for requests resent whole (INIT, ...)


class IOLoop:
    """State owned by the agent's I/O thread: channels, requests in flight, small-key batches."""

    def __init__(self, config: LoopConfig, commands: CommandQueue, tables: SharedTable, counters: Counters,
                 registration: Registration) -> None:
        """Made on the I/O thread itself (its sockets are used by that thread only)."""
        self.config = config
        self.commands = commands
        self.tables = tables                   # replaced here on a redirect or failover
        self.counters = counters
        self.registration = registration       # read here to register again (``rejoin``)
        self.handlers: dict[type, Callable[[Any], None]] = {
            PushCmd: self.do_push, PullCmd: self.do_pull, InitCmd: self.do_init, BcastCmd: self.do_bcast,
            StateCmd: self.do_state, FlushCmd: self.do_flush, TableCmd: self.do_table, StopCmd: self.do_stop}
        self.table = Table()
        self.transport = Transport(config.ctx, config.transport, label=f"autops-agent-{config.rank}",
                                   security=config.security, config=config.transport_config)
        self.channel_agg: dict[Channel, str] = {}
        self.inflight: dict[int, Request] = {}
        self.reqs = itertools.count(1)
        self.poller = zmq.Poller()
        self.poller.register(commands.fd, zmq.POLLIN)
        self.batch_push: dict[str, list[Part]] = collections.defaultdict(list)
        self.batch_pull: dict[str, list[Part]] = collections.defaultdict(list)
        self.batch_keys: dict[str, set[str]] = collections.defaultdict(set)     # the keys in batch_push
        # large keys' pushes of this burst of commands over sockets, per (aggregator, op)
        self.coalesced = Coalescer()
        self.coalesces = config.coalesce       # off: each large key's push goes as a message of its own
        self.small: dict[str, set[str]] = {}
        self.routes: dict[str, Channel] = {}                       # agg -> its channel (as the table says)
        self.lending: dict[str, bool] = {}                         # agg -> staged pushes reach it by reference
        # key -> its lendable push buffers: one, or two where the push kept for a failure is
        # the staged one itself (``free_stage``), not a copy: with fault tolerance in sum
        # mode (a server-mode aggregator sums into the first staged push it holds)
        self.staging: dict[str, list[Shared]] = {}
        self.keeps_staged = config.fault_tolerant and config.mode == "sum"
        # sum mode over a socket: a push_pull's push is kept by reference until its pull is
        # answered (the caller leaves the array alone until then), then the value pulled (the
        # received frame) stands in for it: a RECOVER carries it, so no push is copied
        self.keeps_aggregates = config.fault_tolerant and config.mode == "sum"
        self.staged_busy: dict[str, int] = {}                      # key -> iteration not yet pulled
        self.ahead: set[str] = set()                               # aggregators keys move to: prepared ahead
        self.running = True
        self.master = MasterClient(config.ctx, config.master, config.timeout, config.security)
        # profiling: (iteration, time) of the first push of each new iteration this period
        self.last_iteration = 0
        self.marks: list[tuple[int, float]] = []
        self.next_profile = time.monotonic() + PROFILE_PERIOD
        # failures: each push until no rank can need it again (the pull of the next iteration
        # was answered, or this rank holds the value of its own), as a private copy (``owned``,
        # reused through ``spare``), a staged buffer or a reference to the caller's array; the
        # last iteration pulled per key and, in sum mode, the value pulled then; when to ask
        # pMaster next
        self.kept: dict[str, dict[int, np.ndarray]] = {}
        self.owned: dict[str, set[int]] = {}
        self.spare: dict[str, list[np.ndarray]] = {}
        self.pulled: dict[str, int] = {}
        self.aggregates: dict[str, np.ndarray] = {}                # key -> the value of pulled[key]
        self.next_probe = time.monotonic() + PROBE_AFTER
        self.probe_req: int | None = None
        self.poller.register(self.master.sock, zmq.POLLIN)

    def close(self) -> None:
        self.master.close()
        self.staging.clear()
        self.transport.close()

    def lends(self, agg: str) -> bool:
        """Whether pushes staged in lendable memory reach ``agg`` by reference and are read
        there in place (saving its copy): shm. Over a one-sided kind the aggregator READs
        the caller's array itself, so nothing is staged."""
        found = self.lending.get(agg)
        if found is None:
            found = self.lending[agg] = self.transport.reads_in_place(self.table.aggs.get(agg, {}))
        return found

    def free_stage(self, spec: KeySpec) -> Shared | None:
        """A lendable buffer of the key that nothing needs any more, or None: the aggregator
        may still read the key's last staged push (until it answers its pull), and a staged
        push kept for a failure stays until ``pulled_answered`` lets it go."""
        if spec.key in self.staged_busy:
            return None
        kept = self.kept.get(spec.key)
        for buf in self.stage(spec):
            if not kept or not any(arr is buf.array for arr in kept.values()):
                return buf
        return None

    def stage(self, spec: KeySpec) -> list[Shared]:
        """The lendable buffers of a key; allocated for all not-yet-staged large keys at once."""
        if spec.key not in self.staging:
            todo = [s for k, s in self.table.keys.items()
                    if not s.small and k not in self.staging and self.lends(self.table.final_owner(k))]
            if spec.key not in {s.key for s in todo}:
                todo.append(spec)
            copies = 2 if self.keeps_staged else 1
            buffers = self.transport.memory.allocate([(s.numel, s.dtype) for s in todo for _ in range(copies)],
                                                     self.config.job)
            for n, s in enumerate(todo):
                self.staging[s.key] = buffers[n * copies:(n + 1) * copies]
        return self.staging[spec.key]

    def fail_all(self, exc: BaseException) -> None:
        for req in list(self.inflight.values()):
            for part in req.parts:
                part.finish(exc)
        self.inflight.clear()

    def forget_routes(self, agg: str | None = None) -> None:
        """The table changed (for ``agg``, or all): look channels and lending up again."""
        if agg is None:
            self.routes, self.lending = {}, {}
        else:
            self.routes.pop(agg, None)
            self.lending.pop(agg, None)

    def channel_for(self, agg: str) -> Channel:
        """The transport's channel to ``agg`` (one per address: if an aggregator's address
        changes, the old channel stays open so replies to requests in flight arrive)."""
        channel = self.routes.get(agg)
        if channel is not None:
            return channel
        info = self.table.aggs.get(agg)
        if info is None:
            raise AutoPSError(f"aggregator {agg!r} is not in the table")
        try:
            channel = self.transport.connect(info)
        except TransportError as exc:
            raise AutoPSError(f"aggregator {agg}: {exc}") from None
        if channel not in self.channel_agg:
            self.channel_agg[channel] = agg
            for pollable in channel.pollables:
                self.poller.register(pollable, zmq.POLLIN)
        self.routes[agg] = channel
        return channel

    def run(self) -> None:
        commands = self.commands
        while self.running:
            events = dict(self.poller.poll(100))
            if commands.fd in events:
                commands.clear()
            for cmd in commands.drain():
                self.command(cmd)
                if not self.running:
                    return
            self.send_coalesced()
            for channel in list(self.channel_agg):
                while (inbound := channel.recv()) is not None:
                    self.reply(channel, inbound)
            self.expire()
            self.master_replies()
            if (self.inflight or self.kept) and time.monotonic() >= self.next_probe \
                    and not self.registration.done:
                self.probe()
            if self.ahead and not self.inflight:
                self.prepare_ahead()        # once this iteration's requests are all answered
            if time.monotonic() >= self.next_profile:
                self.profile()

    def prepare_ahead(self) -> None:
        """Connect to the aggregators keys are moving to and map their published buffers (on
        a low-priority helper thread): the switch iteration's first requests then find the
        connection made (a TCP handshake, an RDMA queue pair) and the memory mapped."""
        payload = None
        for agg in sorted(self.ahead):
            known = len(self.channel_agg)
            try:
                channel = self.channel_for(agg)
                channel.open()
            except AutoPSError as exc:
                log.info("cannot connect to %s ahead of a move: %s", agg, exc)
            else:
                if len(self.channel_agg) > known and channel.kind == "tcp" and self.config.warm_bytes:
                    payload = self.warm(channel, payload)
            info = self.table.aggs.get(agg)
            if info is not None:
                self.transport.premap(info)
        self.ahead.clear()

    def warm(self, channel: Channel, payload: np.ndarray | None) -> np.ndarray:
        """Carry ``warm_bytes`` to the new owner and back over a TCP connection just opened
        for a move. A fresh connection's first large transfer starts from the kernel's initial
        socket buffers and an unbounded slow-start threshold: it overshoots the link's queue,
        loses a burst and drains slowly (measured: it made a job's first move onto new
        aggregators its longest pause). Here that happens in the lead iterations' idle time,
        and the switch finds the connection grown. Returns the payload (one for every
        connection warmed at once; the channel keeps it until the peer has read it)."""
        if payload is None:
            payload = np.ones(self.config.warm_bytes, np.uint8)     # filled: no shared zero pages to splice
        channel.send(wire.header(wire.WARM), [payload])
        return payload

    def profile(self) -> None:
        """One PROFILE record per period: iterations started and their mean duration."""
        now = time.monotonic()
        self.next_profile = now + PROFILE_PERIOD
        marks = self.marks
        count, duration = 0, None
        if len(marks) >= 2:
            count = marks[-1][0] - marks[0][0]
            duration = (marks[-1][1] - marks[0][1]) / count if count > 0 else None
        self.marks = marks[-1:]
        config = self.config
        try:
            self.master.sock.send_multipart(wire.encode(
                wire.PROFILE, job=config.job, secret=self.registration.secret, rank=config.rank,
                iteration=self.last_iteration, count=count, duration=duration), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass        # the master is unreachable; the next period tries again

    # commands ---------------------------------------------------------------------------
    def command(self, cmd: Command) -> None:
        try:
            self.handlers[type(cmd)](cmd)
        except Exception as exc:  # report to the caller's handle instead of dying
            handle = getattr(cmd, "handle", None)
            if handle is None:
                raise
            fail_pending(handle, as_autops_error(exc, cmd.kind))

    def do_flush(self, cmd: FlushCmd) -> None:
        self.flush_all()

    def do_table(self, cmd: TableCmd) -> None:
        self.send_coalesced()          # routed by the table they were sent under
        self.table = cmd.table
        self.small = {}
        self.forget_routes()

    def do_stop(self, cmd: StopCmd) -> None:
        self.flush_all()
        self.send_coalesced()
        self.running = False

    def small_of(self, agg: str, iteration: int) -> set[str]:
        """Small keys that ``agg`` serves at ``iteration`` (one batch per aggregator)."""
        cache = (agg, iteration if self.table.moves else None)
        if cache not in self.small:
            if len(self.small) > 256:
                self.small.clear()
            self.small[cache] = {k for k, s in self.table.keys.items()
                                 if s.small and self.table.route(k, iteration) == agg}
        return self.small[cache]

    def do_push(self, cmd: PushCmd) -> None:
        """Push ``flat`` (and, with ``out``, pull the result into it: one PUSH_PULL per key)."""
        flat, iteration, handle, hp, out = cmd.flat, cmd.iteration, cmd.handle, cmd.hp, cmd.out
        if iteration > self.last_iteration:
            self.last_iteration = iteration
            self.marks.append((iteration, time.monotonic()))
        for spec in cmd.specs:
            agg = self.table.route(spec.key, iteration)
            sl = slice(spec.offset, spec.offset + spec.numel)
            part = Part(spec, handle, iteration, data=flat[sl], out=out[sl] if out is not None else None, hp=hp)
            self.route_push(agg, part)
            if self.config.fault_tolerant:
                # after the send: a copy overlaps the transfer
                borrow = self.keeps_aggregates and part.fused and part.staged is None and not self.lends(agg)
                self.keep(spec, iteration, part.data, part.staged if self.keeps_staged else None, borrow)

    def route_push(self, agg: str, part: Part) -> None:
        """Batch a small key's push, or stage and send a large one's."""
        spec = part.spec
        if spec.small:
            if spec.key in self.batch_keys[agg]:
                self.flush(agg)
            self.batch_push[agg].append(part)
            self.batch_keys[agg].add(spec.key)
            part.handle.batched = True
            self.maybe_flush(agg)
            return
        staged = self.free_stage(spec) if self.lends(agg) else None
        if staged is not None:
            # the aggregator reads the staged copy in place until it answers our pull of
            # this iteration
            part.staged = staged
            np.copyto(staged.array, part.data)
            self.staged_busy[spec.key] = part.iteration
        op = wire.PUSH_PULL if part.fused else wire.PUSH
        if staged is not None or not self.coalesces:
            self.send(agg, op, [part])
            return
        limit = self.registration.partition_bytes or 0
        for parts in self.coalesced.add((agg, op), spec.key, part.data.nbytes, part, limit):
            self.send_parts(agg, op, parts)

    def send_coalesced(self) -> None:
        """The burst of commands ended: send the pushes still grouped, one message each."""
        for (agg, op), parts in self.coalesced.drain():
            self.send_parts(agg, op, parts)

    def send_parts(self, agg: str, op: str, parts: list[Part]) -> None:
        """``send``, with a failure reported to the parts' handles (they came from several
        commands, so no one command's error handling covers them)."""
        try:
            self.send(agg, op, parts)
        except Exception as exc:  # noqa: BLE001 -- to the callers, as a failed command would
            err = as_autops_error(exc, "push")
            for part in parts:
                part.finish(err)

    def do_pull(self, cmd: PullCmd) -> None:
        flat, iteration, handle = cmd.flat, cmd.iteration, cmd.handle
        for spec in cmd.specs:
            agg = self.table.route(spec.key, iteration)
            part = Part(spec, handle, iteration, out=flat[spec.offset:spec.offset + spec.numel])
            if spec.small:
                self.batch_pull[agg].append(part)
                handle.batched = True
                self.maybe_flush(agg)
            else:
                self.send(agg, wire.PULL, [part])

    def maybe_flush(self, agg: str) -> None:
        """Send ``agg``'s batch once it holds every small key it serves (pushes, pulls, or both)."""
        batch_push, batch_pull = self.batch_push[agg], self.batch_pull[agg]
        batch = batch_push or batch_pull
        small = self.small_of(agg, batch[-1].iteration if batch else 0)
        if len(batch_push) < len(small) and len(batch_pull) < len(small):
            return              # cannot cover them yet (cheap: no sets per small key)
        pushed = self.batch_keys[agg]
        pulled = {p.spec.key for p in batch_pull} | {p.spec.key for p in batch_push if p.fused}
        if pushed >= small and (not pulled or pulled >= small):
            self.flush(agg)
        elif not pushed and pulled >= small:
            self.flush(agg)

    def flush(self, agg: str) -> None:
        pushes, pulls = self.batch_push.pop(agg, []), self.batch_pull.pop(agg, [])
        self.batch_keys.pop(agg, None)
        fused = [p for p in pushes if p.fused]
        if fused:
            self.send(agg, wire.PUSH_PULL, fused)
        if len(fused) < len(pushes):
            self.send(agg, wire.PUSH, [p for p in pushes if not p.fused])
        if pulls:
            self.send(agg, wire.PULL, pulls)

    def flush_all(self) -> None:
        for agg in list(set(self.batch_push) | set(self.batch_pull)):
            self.flush(agg)

    def request(self, agg: str, kind: str, parts: list[Part], op: str, payloads: list = (),
                **fields: Any) -> None:
        """Send one request of this job and rank to ``agg``; its reply completes ``parts``."""
        channel = self.channel_for(agg)
        req = next(self.reqs)
        config = self.config
        head = wire.header(op, req=req, job=config.job, secret=self.registration.secret, rank=config.rank,
                           **fields)
        now = time.monotonic()
        self.inflight[req] = Request(kind, agg, parts, now + config.timeout, now,
                                     (op, list(payloads), fields) if kind in (wire.INIT, wire.BCAST_PUT,
                                                                              wire.BCAST_GET) else None)
        channel.send(head, payloads)

    def send(self, agg: str, op: str, parts: list[Part], replay: bool = False) -> None:
        """A PUSH, PUSH_PULL, PULL or STATE_GET of ``parts``, all served by ``agg``; ``replay``:
        pushes resent after a failure (the aggregator skips what it has)."""
        if op not in (wire.PUSH, wire.PUSH_PULL):
            self.request(agg, op, parts, op, items=[wire.PullItem(p.spec.key, p.iteration).to_wire() for p in parts])
            return
        lends = self.lends(agg) and not replay
        items, payloads = [], []
        if len(parts) > 1 and all(p.spec.small for p in parts):
            # a batch of small keys: one payload for all of them, not one frame each
            blob, spans = wire.pack([p.data for p in parts])
            items = [wire.PushItem(p.spec.key, p.iteration, wire.Slice(0, offset, nbytes), p.hp).to_wire()
                     for p, (offset, nbytes) in zip(parts, spans)]
            payloads = [blob]
        else:
            for p in parts:
                items.append(wire.PushItem(p.spec.key, p.iteration, wire.Slice(len(payloads), 0, p.data.nbytes),
                                           p.hp).to_wire())
                payloads.append(p.staged if p.staged is not None and lends else p.data)
        if replay:
            self.request(agg, op, parts, op, payloads, items=items, replay=True)
        else:
            self.request(agg, op, parts, op, payloads, items=items)

    def do_init(self, cmd: InitCmd) -> None:
        flat, handle, state = cmd.flat, cmd.handle, cmd.state
        per_agg: dict[str, list] = collections.defaultdict(list)
        for spec in cmd.specs:
            per_agg[self.table.route(spec.key, 0)].append(spec)
        for agg, agg_specs in per_agg.items():
            payloads, items, parts = [], [], []
            for spec in agg_specs:
                sl = slice(spec.offset, spec.offset + spec.numel)
                param = flat[sl]
                staged = self.free_stage(spec) if not spec.small and self.lends(agg) else None
                if staged is not None:                 # copied by the aggregator before it acks
                    np.copyto(staged.array, param)
                    self.staged_busy[spec.key] = 0
                    param = staged
                data = wire.Slice(len(payloads), 0, flat[sl].nbytes)
                payloads.append(param)
                slices = {}
                for name, arr in state.items():
                    slices[name] = wire.Slice(len(payloads), 0, arr[sl].nbytes)
                    payloads.append(arr[sl])
                items.append(wire.InitItem(spec.key, data, int(cmd.step), slices).to_wire())
                parts.append(Part(spec, handle, 0))
            self.request(agg, wire.INIT, parts, wire.INIT, payloads, items=items, hp=cmd.hp)

    def do_state(self, cmd: StateCmd) -> None:
        per_agg: dict[str, list[Part]] = collections.defaultdict(list)
        for spec in cmd.specs:
            per_agg[self.table.route(spec.key, cmd.iteration)].append(Part(spec, cmd.handle, cmd.iteration))
        for agg, parts in per_agg.items():
            self.send(agg, wire.STATE_GET, parts)

    def do_bcast(self, cmd: BcastCmd) -> None:
        config = self.config
        name, flat, root, seq = cmd.name, cmd.flat, cmd.root, cmd.seq
        agg = self.table.home or config.aggregators[0]
        part = Part(KeySpec(name, name, 0, flat.size, str(flat.dtype), False), cmd.handle, seq,
                    data=flat if config.rank == root else None, out=None if config.rank == root else flat)
        if config.rank == root:
            self.request(agg, wire.BCAST_PUT, [part], wire.BCAST_PUT, [flat.view(np.uint8)], name=name, seq=seq,
                         dtype=str(flat.dtype), shape=[flat.size])
        else:
            self.request(agg, wire.BCAST_GET, [part], wire.BCAST_GET, name=name, seq=seq)

    # replies ----------------------------------------------------------------------------
    def reply(self, channel: Channel, inbound: Inbound) -> None:
        try:
            msg = wire.parse(inbound.header, inbound.payloads, inbound.lent)
        except wire.ProtocolError as exc:
            log.warning("bad reply from aggregator %s: %s", self.channel_agg.get(channel), exc)
            return
        if msg.op == wire.WARM:
            self.counters.warmed += 1
            return
        request = self.inflight.pop(msg.get("req"), None)
        if request is None:
            return      # timed out earlier
        if msg.op == wire.ERROR:
            err = AutoPSError(f"aggregator {request.agg}: {msg['message']}")
            if not request.parts:
                log.error("%s refused by aggregator %s: %s", request.kind, request.agg, msg["message"])
            for part in request.parts:
                part.finish(err)
        elif msg.op == wire.REDIRECT:
            self.redirect(request, msg)
        elif msg.op == wire.PULL_REPLY:
            self.fill(request, msg)
        elif msg.op == wire.STATE_REPLY:
            self.fill_state(request, msg)
        elif request.kind == wire.PUSH_PULL:
            err = AutoPSError(f"aggregator {request.agg} answered a push_pull with {msg.op}, not the pulled value")
            for part in request.parts:
                part.finish(err)
        else:
            if request.kind == wire.INIT:
                for part in request.parts:
                    if self.staged_busy.get(part.spec.key) == 0:
                        del self.staged_busy[part.spec.key]
            for part in request.parts:
                part.finish()

    def fill(self, request: Request, msg: wire.Message) -> None:
        try:
            items = msg.items(wire.PullReplyItem)
        except wire.ProtocolError as exc:
            items, error = [], AutoPSError(f"pull reply from {request.agg}: {exc}")
        else:
            error = None
        by_key = {p.spec.key: p for p in request.parts}
        moved: list[wire.Move] = []
        for item in items:
            part = by_key.pop(item.key, None)
            if part is None:
                continue
            try:
                data = item.data
                src = msg.whole(item.payload, part.out.dtype) if data is None else msg.array(data, part.out.dtype)
                lent = data is None and item.payload in msg.lent
            except wire.ProtocolError as exc:
                part.finish(AutoPSError(f"pull of {part.spec.key!r}: bad reply: {exc}"))
                continue
            if src.size != part.out.size:
                part.finish(AutoPSError(
                    f"pull of {part.spec.key!r}: reply has {src.size} elements, expected {part.out.size}"))
                continue
            pulled = request.kind in (wire.PULL, wire.PUSH_PULL)
            if pulled and self.keeps_aggregates and lent:
                self.own_kept(part.spec, part.iteration)    # before ``out`` (maybe the push) changes
            np.copyto(part.out, src)
            if pulled:
                self.pulled_answered(part.spec.key, part.iteration,
                                     src if self.keeps_aggregates and not lent else None)
            if self.staged_busy.get(part.spec.key, 1 << 62) <= part.iteration:
                del self.staged_busy[part.spec.key]     # the aggregator is done with our staged push
            part.finish()
            if item.moved is not None:
                moved.append(item.moved)
        for part in by_key.values():
            part.finish(error or AutoPSError(f"pull reply from {request.agg} lacks {part.spec.key!r}"))
        for move in moved:        # after the worker has its values: off its critical path
            self.learn_move(move)

    def fill_state(self, request: Request, msg: wire.Message) -> None:
        by_key = {p.spec.key: p for p in request.parts}
        try:
            copies = list(wire.key_copies(msg))
        except wire.ProtocolError as exc:
            copies, error = [], AutoPSError(f"state reply from {request.agg}: {exc}")
        else:
            error = AutoPSError(f"state reply from {request.agg} lacks a key")
        for key, meta, views in copies:
            part = by_key.pop(key, None)
            if part is None:
                continue
            try:
                arrays = [np.frombuffer(v, dtype=part.spec.dtype) for v in views]
                part.absorb(meta, arrays)
            except (AutoPSError, ValueError) as exc:
                part.finish_state(exc if isinstance(exc, AutoPSError) else AutoPSError(str(exc)))
                continue
            part.finish_state()
        for part in by_key.values():
            part.finish_state(error)

    def learn_move(self, move: wire.Move) -> None:
        """The old owner said: ``move.key`` is served by ``move.to`` from ``move.first`` on."""
        if self.table.moves.get(move.key) == (move.to, move.first):
            return
        self.table.learn(move.key, move.to, move.first, move.info)
        self.small = {}
        self.forget_routes(move.to)
        self.ahead.add(move.to)

    def redirect(self, request: Request, msg: wire.Message) -> None:
        """The key moved: learn where from the reply (or, without details, from pMaster's
        table) and resend every part of the request to its owner."""
        self.counters.redirects += 1
        try:
            moves = msg.items(wire.Move)
        except wire.ProtocolError as exc:
            log.warning("malformed redirect from %s: %s", request.agg, exc)
            moves = []
        if moves:
            for move in moves:
                self.learn_move(move)
        else:
            reply = self.master.call(wire.GET_TABLE, job=self.config.job, secret=self.registration.secret)
            if int(reply.get("epoch") or 0) > self.table.epoch:
                self.failover(reply, [request])
                return
            table = Table()
            table.load(reply)
            self.table = table
            self.small = {}
            self.forget_routes()
            self.tables.replace(table)
        table = self.table
        per_agg: dict[str, list[Part]] = collections.defaultdict(list)
        for part in request.parts:
            per_agg[table.route(part.spec.key, part.iteration)].append(part)
        for agg, parts in per_agg.items():
            self.send(agg, request.kind, parts)

    # failures ---------------------------------------------------------------------------
    def keep(self, spec: KeySpec, iteration: int, data: np.ndarray, staged: Shared | None = None,
             borrow: bool = False) -> None:
        """Keep this rank's push of ``iteration`` (replayed if its aggregator is lost): the
        ``staged`` copy itself when there is one -- ``free_stage`` leaves it alone until
        ``pulled_answered`` --, ``data`` itself when ``borrow`` (a push_pull over a socket:
        ``fill`` replaces it with the value pulled before the caller may touch it), else a
        copy."""
        kept = self.kept.setdefault(spec.key, {})
        owned = self.owned.setdefault(spec.key, set())
        old = kept.pop(iteration, None)
        if iteration not in owned:
            old = None                      # a staged or borrowed buffer is not ours to copy into
        owned.discard(iteration)
        if staged is not None or borrow:
            if old is not None:
                self.spare.setdefault(spec.key, []).append(old)
            kept[iteration] = staged.array if staged is not None else data
            return
        if old is None:
            spare = self.spare.get(spec.key)
            old = spare.pop() if spare else np.empty(spec.numel, spec.dtype)
        np.copyto(old, data)
        kept[iteration] = old
        owned.add(iteration)

    def own_kept(self, spec: KeySpec, iteration: int) -> None:
        """Copy a borrowed push of ``iteration`` before the caller's array is overwritten
        (its pull was answered with a value this rank cannot keep: lent memory)."""
        arr = self.kept.get(spec.key, {}).get(iteration)
        if arr is not None and iteration not in self.owned.get(spec.key, ()) \
                and not any(buf.array is arr for buf in self.staging.get(spec.key, ())):
            self.keep(spec, iteration, arr)

    def pulled_answered(self, key: str, iteration: int, value: np.ndarray | None = None) -> None:
        """The pull of ``iteration`` was answered: every rank has pushed it, hence pulled
        ``iteration - 1``, so no rank can need the pushes before ``iteration`` again. With
        the ``value`` pulled (memory of this rank's own, kept by reference): a RECOVER gives it
        to a new owner instead of this rank's push of ``iteration``, so that goes too."""
        if iteration <= self.pulled.get(key, 0):
            return
        self.pulled[key] = iteration
        if value is not None:
            self.aggregates[key] = value
        else:
            self.aggregates.pop(key, None)
        kept = self.kept.get(key)
        if not kept:
            return
        owned = self.owned.get(key, set())
        spare = self.spare.setdefault(key, [])
        for old in [it for it in kept if it < iteration or (value is not None and it == iteration)]:
            buf = kept.pop(old)
            if old in owned:
                owned.discard(old)
                if len(spare) < 2:
                    spare.append(buf)

    def probe(self) -> None:
        """Ask pMaster whether the job's keys moved after a failure (``epoch``; the answer is
        small when nothing moved). Not waited for: ``master_replies`` takes the answer."""
        self.next_probe = time.monotonic() + PROBE_AFTER
        config = self.config
        try:
            self.probe_req = self.master.send(wire.GET_TABLE, job=config.job, secret=self.registration.secret,
                                              rank=config.rank, since=self.table.epoch)
        except zmq.ZMQError:
            pass            # pMaster unreachable; the next period tries again

    def master_replies(self) -> None:
        """pMaster's answers to probes (other replies on this socket are stale)."""
        while True:
            try:
                frames = self.master.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = wire.decode(frames)
            except wire.ProtocolError as exc:
                log.warning("bad reply from pMaster: %s", exc)
                continue
            if self.probe_req is None or reply.get("req") != self.probe_req:
                continue
            self.probe_req = None
            if reply.op == wire.ERROR:
                if "is not registered" in reply["message"]:
                    self.rejoin()           # pMaster restarted
                else:
                    self.fail_all(AutoPSError(f"master: {reply['message']}"))   # e.g. state lost with an aggregator
            elif reply.get("keys") is not None and int(reply.get("epoch") or 0) > self.table.epoch:
                self.failover(reply)

    def rejoin(self) -> None:
        """pMaster restarted and does not know the job yet: register this rank again (with
        the job's secret) and declare its tensors again. pMaster rebuilt the table from what
        its aggregators hold; until they have registered it asks to retry (next probe)."""
        config = self.config
        short = min(config.timeout, max(PROBE_AFTER, 1.0))
        try:
            self.master.call(wire.REGISTER_JOB, timeout=short, secret=self.registration.secret, rejoin=True,
                             **self.registration.fields)
            reply = self.master.call(wire.DECLARE, timeout=config.timeout, job=config.job,
                                     secret=self.registration.secret,
                                     tensors=list(self.registration.declared))
        except MasterUnreachable as exc:
            log.debug("rejoin: %s", exc)
            return
        except AutoPSError as exc:
            if "retry" in str(exc):
                return
            self.fail_all(exc)
            return
        log.warning("job %s rank %d: registered again with a restarted pMaster", config.job, config.rank)
        self.failover(reply)

    def failover(self, reply: wire.Message, extra: Iterable[Request] = ()) -> None:
        """pMaster moved keys after losing aggregators: take its table, tell each new owner
        of a moved key the last iteration this rank pulled (RECOVER), replay the pushes kept
        for those keys and resend every request that was waiting for them."""
        old, new = self.table, Table()
        new.load(reply)
        lost = new.lost

        def moved(key: str) -> bool:
            move = old.moves.get(key)
            return old.owner.get(key) in lost or (move is not None and move[0] in lost) \
                or new.owner.get(key) != old.owner.get(key)

        affected = {k for k in new.keys if moved(k)}
        dropped = list(extra)
        for req, request in list(self.inflight.items()):
            if request.agg in lost or any(p.spec.key in affected for p in request.parts):
                dropped.append(self.inflight.pop(req))
        unsent = [p for batch in (*self.batch_push.values(), *self.batch_pull.values()) for p in batch]
        self.batch_push.clear()
        self.batch_pull.clear()
        self.batch_keys.clear()
        self.table = new
        self.small = {}
        self.forget_routes()
        self.tables.replace(new)
        if affected:
            log.warning("job %s rank %d: aggregator(s) %s lost; %d key(s) recover on %s", self.config.job,
                        self.config.rank, sorted(lost), len(affected), sorted({new.owner[k] for k in affected}))
        recover: dict[str, tuple[list, list]] = collections.defaultdict(lambda: ([], []))
        for key in sorted(affected):
            items, values = recover[new.owner[key]]
            held = self.aggregates.get(key)
            value = None
            if held is not None:
                value = wire.Slice(len(values), 0, held.nbytes)
                values.append(held)
            items.append(wire.RecoverItem(key, self.pulled.get(key, 0), value).to_wire())
        for agg, (items, values) in recover.items():
            self.request(agg, wire.RECOVER, [], wire.RECOVER, values, items=items)
        pushes: dict[tuple, Part] = {}
        pulls: list[Part] = []
        for request in dropped:
            if request.resend is not None:
                self.resend_whole(request)
                continue
            unsent.extend(request.parts)
        for part in unsent:                      # dropped, or batched and not sent yet
            push, pull = part.halves() if part.fused else (part, None) if part.data is not None else (None, part)
            if push is not None:
                pushes[(push.spec.key, push.iteration)] = push
            if pull is not None:
                pulls.append(pull)
        replay: dict[tuple, list[Part]] = collections.defaultdict(list)     # (iteration, agg) -> parts
        for key in sorted(affected):
            for it, copy in sorted(self.kept.get(key, {}).items()):
                part = pushes.pop((key, it), None)
                handle = part.handle if part is not None else BackgroundHandle(key)
                replay[(it, new.route(key, it))].append(Part(new.keys[key], handle, it, data=copy,
                                                             hp=part.hp if part is not None else None))
        for part in pushes.values():            # not kept (fault tolerance off) or not affected
            replay[(part.iteration, new.route(part.spec.key, part.iteration))].append(
                Part(new.keys.get(part.spec.key, part.spec), part.handle, part.iteration, data=part.data, hp=part.hp))
        for (_, agg), parts in sorted(replay.items(), key=lambda kv: kv[0]):
            self.send(agg, wire.PUSH, parts, replay=True)
        by_kind: dict[tuple, list[Part]] = collections.defaultdict(list)
        for part in pulls:
            kind = wire.STATE_GET if isinstance(part.handle, StateHandle) else wire.PULL
            by_kind[(new.route(part.spec.key, part.iteration), kind)].append(part)
        for (agg, kind), parts in by_kind.items():
            self.send(agg, kind, parts)

    def resend_whole(self, request: Request) -> None:
        """Resend an INIT or broadcast to whoever serves it now."""
        op, payloads, fields = request.resend
        if op == wire.INIT:
            agg = self.table.route(request.parts[0].spec.key, 0)
        else:
            agg = self.table.home or self.config.aggregators[0]
        self.request(agg, request.kind, request.parts, op, payloads, **fields)

    def expire(self) -> None:
        now = time.monotonic()
        for req, request in list(self.inflight.items()):
            if now > request.deadline:
                del self.inflight[req]
                keys = ", ".join(p.spec.key for p in request.parts[:4])
                more = f" and {len(request.parts) - 4} more" if len(request.parts) > 4 else ""
                its = sorted({p.iteration for p in request.parts})
                err = TimeoutError(
                    f"job {self.config.job} rank {self.config.rank}: {request.kind} of {keys}{more} "
                    f"(iteration {its[0] if len(its) == 1 else its}) at aggregator {request.agg} got no reply "
                    f"within {self.config.timeout:.0f}s; another worker of the job may have died or the "
                    f"aggregator is down (AUTOPS_TIMEOUT sets this limit)")
                for part in request.parts:
                    part.finish(err)
