"""A tensor-parallel group's worker processes: one step, one group.

The N workers of a group (one per device, rank 0 the *leader*) each join the group's
``torch.distributed`` process group ("hccl": HCCL on the NPU, npusim's on the sim) before
they load their programs, whose captured graphs then hold the group's collectives. A
collective completes only when every rank runs it, so every rank must replay the same
steps in the same order. Clients reach the leader only; the leader forwards, over a
ZeroMQ channel of its own, what it does with each request:

    P seq owner REQUEST   the leader planned a device request (a step, add, decode,
                          prefill, update, replay, kv op): plan it the same way
    C owner REQUEST       the leader applied a sequence change (append_blocks, free)
    X owner               the leader released a client that went (its last connection
                          closed, its grace passed): release it too
    I seq                 the leader issued plan ``seq`` to its device: issue it too
    E                     the leader stops: finish what is issued, then exit

A follower plans at the leader's plan points and issues at its issue points, so its
programs' host state (a model's sequences, which decode plans advance and changes edit)
and its device work follow the leader's exactly, whatever the leader refused or queued in
between: a plan the leader never issues (refused BUSY once planned, or timed out while
queued) is dropped by the follower when a later plan is issued (issue order is plan
order, less what was dropped). Only the leader replies.

Why ZeroMQ and not a broadcast over a gloo group: the leader must never wait for a
follower to take a request (a gloo broadcast is a collective: the leader's socket
thread would block on the slowest rank); ZeroMQ queues per peer, keeps each peer's
order, and carries a request's tensors as frames of their own, as the client's socket
does. (vLLM broadcasts its scheduler's output through a shared-memory ring for the same
reason.) A ROUTER with ROUTER_MANDATORY on the leader, a DEALER per follower that says
it is ready once its programs are captured: the leader tells the orchestrator it is
ready only when every follower is.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from graphlane.protocol import ops, wire
from graphlane.protocol.errors import BadRequest
from graphlane.protocol.server import Origin
from graphlane.workers.job import Job
from graphlane.workers.process_group import GroupSpec, GroupUnavailable
from graphlane.workers.spec import WorkerSpec
from graphlane.workers.worker import Worker, worker_main

log = logging.getLogger("graphlane.worker")

_PLAN, _CHANGE, _ISSUE, _END, _READY = b"P", b"C", b"I", b"E", b"R"
_RELEASE = b"X"


def group_main(spec: WorkerSpec, conn: Connection) -> None:
    """Process entry point (spawn) of a rank's worker: the leader serves clients, the
    others follow it."""
    assert spec.group is not None
    worker_main(spec, conn, GroupLeader if spec.group.rank == 0 else GroupFollower)


def _owner(owner: Any) -> Any:
    """An owner as it crosses the channel: a key (str) or a routing id (bytes)."""
    return owner if isinstance(owner, str) else bytes(owner)


class _GroupWorker(Worker):
    """What a rank of a group adds to a worker: its place in the group, in hello and
    status, and the channel's context (apart from the client socket's, which the
    worker destroys at once when it stops)."""

    def __init__(self, spec: WorkerSpec, conn: Connection) -> None:
        super().__init__(spec, conn)
        assert spec.group is not None
        self.group: GroupSpec = spec.group
        self.codec = wire.Codec(spec.limits)
        self.channel_ctx: zmq.Context[Any] = zmq.Context()

    def info(self) -> dict[str, Any]:
        return {**super().info(), "group": self.group.describe()}


class GroupLeader(_GroupWorker):
    """Rank 0: a worker that forwards what it plans, changes and issues to the others."""

    def __init__(self, spec: WorkerSpec, conn: Connection) -> None:
        super().__init__(spec, conn)
        self.channel = self.channel_ctx.socket(zmq.ROUTER)
        self.channel.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a gone follower: an error
        self.channel.setsockopt(zmq.SNDHWM, 0)  # the device work bounds what is queued
        self.channel.setsockopt(zmq.LINGER, 0)
        self.channel.bind(self.group.channel)
        self.followers = [_rank_id(r) for r in range(1, self.group.size)]
        self._seq = 0
        self._planned: dict[Job, int] = {}  # planned, not issued yet, in plan order
        self._await_followers()  # before this worker says it is ready

    def run(self) -> int:
        try:
            return super().run()
        finally:
            self._send(_END)
            self.channel.close(linger=2000)
            self.channel_ctx.destroy(linger=0)

    def _await_followers(self) -> None:
        """Every follower's ready (its programs captured), within the group's limit."""
        waiting = set(self.followers)
        deadline = time.monotonic() + self.group.timeout_s
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0 or not self.channel.poll(int(left * 1000)):
                raise GroupUnavailable(
                    f"group {self.group.index}: rank(s) {sorted(_rank(w) for w in waiting)} "
                    f"not ready within {self.group.timeout_s:g} s"
                )
            ident, kind = self.channel.recv_multipart()[:2]
            if kind == _READY:
                waiting.discard(ident)

    def _send(self, *frames: Any) -> None:
        for ident in self.followers:
            try:
                self.channel.send_multipart([ident, *frames], copy=False)
            except zmq.ZMQError as exc:  # gone: the orchestrator restarts the group
                log.warning("group %d: rank %d unreachable: %s", self.group.index,
                            _rank(ident), exc)  # fmt: skip

    # ------------------------------------------------------------ the forwarding points
    def _job_of(self, body: Any, op: str, owner: Any = None) -> Job:
        job = super()._job_of(body, op, owner)
        self._seq += 1
        self._planned[job] = self._seq
        header = msgspec.msgpack.encode([self._seq, _owner(owner)])
        self._send(_PLAN, header, *self.codec.encode_request(self._seq, op, body))
        return job

    def _sequence_change(self, op: str, body: Any, origin: Origin) -> dict[str, Any]:
        answer = super()._sequence_change(op, body, origin)
        owner = origin.sender if origin.sender is not None else origin.ident
        header = msgspec.msgpack.encode([0, _owner(owner)])
        self._send(_CHANGE, header, *self.codec.encode_request(0, op, body))
        return answer

    def _release(self, owner: Any) -> None:
        # Only the leader sees the clients' connections: without this a follower would
        # keep every gone client's sequences, and past max_sequences refuse (BUSY) an add
        # the leader accepted, and leave the group.
        super()._release(owner)
        self._send(_RELEASE, msgspec.msgpack.encode(_owner(owner)))

    def _issue(self, step: Job) -> None:
        seq = self._planned.pop(step, None)
        planned = self._planned
        while planned and next(iter(planned.values())) < (seq or 0):  # dropped unissued
            del planned[next(iter(planned))]
        if seq is not None:
            self._send(_ISSUE, seq.to_bytes(8, "little"))
        super()._issue(step)


class GroupFollower(_GroupWorker):
    """Rank 1..N-1: plans and issues what the leader forwards; answers no client's step."""

    def __init__(self, spec: WorkerSpec, conn: Connection) -> None:
        super().__init__(spec, conn)
        self.channel = self.channel_ctx.socket(zmq.DEALER)
        self.channel.setsockopt(zmq.IDENTITY, _rank_id(self.group.rank))
        self.channel.setsockopt(zmq.RCVHWM, 0)
        self.channel.setsockopt(zmq.LINGER, 0)
        self.channel.connect(self.group.channel)
        self._pending: dict[int, Job] = {}  # planned, not issued yet (by the leader's seq)
        self.forwarded = 0  # messages taken from the leader
        # Its work comes from its group thread, which needs the interpreter lock an idle
        # poll holds to post it: it sleeps, and that thread's post wakes it.
        self.loop.spin_s = 0.0

    def run(self) -> int:
        # The channel belongs to this thread; the process exits (os._exit) when run
        # returns, which ends the thread and its socket with it.
        threading.Thread(target=self._follow, name="graphlane-group", daemon=True).start()
        return super().run()

    def _follow(self) -> None:
        """The channel's owner: says ready, then hands each forwarded message to the main
        thread, in order."""
        self.channel.send(_READY)
        while True:
            try:
                frames = self.channel.recv_multipart(copy=False)
            except zmq.ZMQError:  # the context is gone: the worker stops
                return
            self.loop.post(functools.partial(self._forwarded, frames))
            if frames[0].bytes == _END:
                return

    def _forwarded(self, frames: list[Any]) -> None:
        kind = frames[0].bytes
        self.forwarded += 1
        try:
            if kind == _ISSUE:
                self._issue_forwarded(int.from_bytes(frames[1].bytes, "little"))
            elif kind in (_PLAN, _CHANGE):
                seq, owner = msgspec.msgpack.decode(frames[1].bytes)
                (req,) = self.codec.decode_requests(frames[2:])
                if isinstance(req, Exception):
                    raise req
                if kind == _PLAN:
                    self._plan_forwarded(seq, req, owner)
                else:
                    fields = {f: getattr(req.body, f) for f in req.body.__struct_fields__}
                    program = self.engine.programs[req.body.program]
                    program.sequence_change(req.op, fields, owner)
            elif kind == _RELEASE:
                owner = msgspec.msgpack.decode(frames[1].bytes)
                for program in self._sequence_programs:
                    program.release(owner)
            elif kind == _END:
                self._stop_when_idle = True
                self._maybe_stop()
        except Exception as exc:  # this rank no longer runs the leader's plan: restart
            log.error(
                "group %d rank %d diverged from the leader (%s: %s); exiting so that the "
                "group restarts", self.group.index, self.group.rank, type(exc).__name__, exc,
                exc_info=exc,
            )  # fmt: skip
            self.exit_code = 6
            self.loop.stopping = True

    def _plan_forwarded(self, seq: int, req: wire.Request, owner: Any) -> None:
        job = self._job_of(req.body, req.op, owner)
        job.owner = owner
        job.request_id = seq
        job.received = time.perf_counter()
        self._pending[seq] = job

    def _issue_forwarded(self, seq: int) -> None:
        pending = self._pending
        while pending and next(iter(pending)) < seq:  # the leader dropped it unissued
            del pending[next(iter(pending))]
        job = pending.pop(seq)
        self._open[job] = None
        self._waiting.append(job)  # issued by the loop's pump as permits allow

    # ------------------------------------------------------------ no replies of its own
    def answer(self, req: wire.Request, origin: Origin) -> Any:
        if ops.OPS[req.op].device:
            g = self.group
            raise BadRequest(
                f"device {g.devices[g.rank]} is rank {g.rank} of tensor-parallel group "
                f"{g.index}: send {req.op} to its leader, device {g.devices[0]} (see hello)"
            )
        return super().answer(req, origin)

    def _begin_drain(self, stop: bool) -> None:
        # Stopped by the leader's end (E), once the leader has issued its last step: a
        # follower that left first would leave the leader's collectives unmet.
        self.draining = True

    def _finish(self, step: Job) -> None:
        self._open.pop(step, None)
        self._progress_at = time.perf_counter()
        if step.results is None:
            log.debug("forwarded %s %d failed: %s", step.kind.value, step.request_id, step.error)
        if self.engine.failure is not None and not self.loop.stopping:
            log.error("device fault, worker exits: %s", self.engine.failure)
            self.exit_code = 5
            self.loop.stopping = True
            return
        self._maybe_stop()

    def status(self) -> dict[str, Any]:
        return {**super().status(), "forwarded": self.forwarded}


def _rank_id(rank: int) -> bytes:
    return b"rank-%d" % rank


def _rank(ident: bytes) -> int:
    return int(ident.rpartition(b"-")[2])


__all__ = ["GroupFollower", "GroupLeader", "group_main"]
