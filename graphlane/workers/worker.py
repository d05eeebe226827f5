"""The worker process: one per device.

Threads and their roles:

- the main thread owns the worker's ROUTER socket and is the step engine's only
  issuer: a plain zmq poll loop receives requests, decodes and validates them,
  issues steps on the device at once (or queues them, bounded, while
  ``max_inflight`` steps are on the device) and sends every reply. It launches
  each step's replay; the engine's *update thread* dispatches the step's patches
  (unless the step is alone in the engine: then the main thread does); a step
  whose device work is complete by the end of its dispatch is answered at once,
  otherwise the engine's *completion thread* waits for it. Either thread hands
  the result back through a wake-up pipe the loop polls beside the socket;
- the *lifeline* thread reads the pipe to the orchestrator: commands (drain,
  stop, ping; run on the main thread, through the same wake-up pipe) and, when
  the orchestrator dies, end-of-file, on which the worker exits at once so that
  no orphan keeps the device.

Startup handshake: the worker captures its programs, binds its socket, then
sends ``pipe.Ready(info)`` on the pipe, or ``pipe.Failed`` with the cause, its
traceback (logged here too) and whether it is permanent (see :func:`start_failure`).

The socket loop and the replies are a :class:`~.loop.WorkerLoop`'s (with the
protocol's :class:`~graphlane.protocol.server.Responder`, which the daemon's socket
uses too); the Worker is the loop's handler: it does what requests ask of the device.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch
import zmq

from graphlane.logs import setup_logging
from graphlane.program_config import ProgramConfigError
from graphlane.protocol import ops, pipe, security, wire
from graphlane.protocol.errors import (
    BadRequest,
    Busy,
    InternalError,
    PredecessorFailed,
    ShuttingDown,
    StateLost,
    Timeout,
    UnknownDevice,
    UnknownProgram,
    as_error,
)
from graphlane.protocol.server import LATER, Origin
from graphlane.workers import affinity
from graphlane.workers.connections import Connections
from graphlane.workers.engine import StepEngine
from graphlane.workers.job import Job, JobKind
from graphlane.workers.loop import WorkerLoop
from graphlane.workers.memory import keep_freed_buffers
from graphlane.workers.metrics import WorkerMetrics
from graphlane.workers.owners import SequenceOwners
from graphlane.workers.programs import StepError
from graphlane.workers.programs.base import GraphKey, GraphProgram
from graphlane.workers.spec import WorkerSpec

log = logging.getLogger("graphlane.worker")


def worker_main(
    spec: WorkerSpec, conn: Connection, worker_class: type[Worker] | None = None
) -> None:
    """Process entry point (spawn: through :mod:`graphlane.workers.entry`); ``worker_class``:
    a Worker's subclass to run instead (a tensor-parallel group's rank:
    graphlane.workers.group.group_main)."""
    setup_logging(spec.log_level, spec.log_format, f"worker[{spec.device}]")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the orchestrator decides when workers stop
    keep_freed_buffers()  # large inputs reuse mapped pages, step after step (see memory.py)
    try:
        affinity.pin(spec.cpus)  # before any thread starts: they all inherit it
        worker = (worker_class or Worker)(spec, conn)
    except BaseException as exc:  # report the failure through the handshake, then exit
        try:
            failed = start_failure(exc)
            mistake = isinstance(exc, ProgramConfigError)  # the config's: its line says all
            log.error(
                "worker cannot start (%s)%s",
                "permanent: not restarted" if failed.permanent else "transient: restarted",
                f": {exc}" if mistake else "",
                exc_info=None if mistake else exc,
            )
            pipe.send(conn, failed)
        finally:
            os._exit(3)
    code = worker.run()
    os._exit(code)


def start_failure(exc: BaseException) -> pipe.Failed:
    """What the handshake says of an exception that stopped the worker's start.

    Permanent unless something in its chain of causes says it may pass: a restart
    meets the same configuration, program, installed packages and devices again, so
    a bad setting, a program's error in its capture, a missing dependency (torch_npu
    not installed) or a device that does not exist fail the same way every time.
    Transient: an error marked ``transient = True`` (device faults, the injected
    ones included) and device memory that is still held (by the worker before it)."""
    transient, seen = False, set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if getattr(cause, "transient", False) is True or isinstance(cause, torch.OutOfMemoryError):
            transient = True
            break
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    message = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line
    trace = "".join(traceback.format_exception(exc))
    return pipe.Failed(message, permanent=not transient, traceback=trace)


class Worker:
    """One device's worker process: the handler of its :class:`WorkerLoop`."""

    def __init__(self, spec: WorkerSpec, conn: Connection) -> None:
        from graphlane.workers.backends import create_backend
        from graphlane.workers.programs import load_program

        self.spec = spec
        self.conn = conn
        if spec.faults.get("fail_start"):
            from graphlane.workers.backends.faults import InjectedStartFault

            raise InjectedStartFault("fault injection: fail_start")
        options: dict[str, Any] = {}
        if spec.backend == "sim" and spec.sim is not None:
            options["config"] = spec.sim
        index = spec.device if spec.runtime_index is None else spec.runtime_index
        backend = create_backend(spec.backend, index, **options)
        if spec.group is not None:  # the group's collectives exist before any program loads
            from graphlane.workers.process_group import join

            join(spec.group, backend)
        programs = [load_program(str(p["name"]), p) for p in spec.programs]
        for program in programs:
            program.check_backend(spec.backend)
        self.sim_extensions: list[str] = []
        if spec.backend == "sim":
            from graphlane.workers.backends.sim import SimBackend

            assert isinstance(backend, SimBackend)
            backend.use_extensions(programs)  # float32 attention is the sim's, not the NPU's
            self.sim_extensions = backend.extensions_on
        hang, fault = spec.faults.get("hang_device_after"), spec.faults.get("device_fault_after")
        if hang is not None or fault is not None:  # tests: a device that misbehaves on cue
            from graphlane.workers.backends.faults import FaultyBackend

            backend = FaultyBackend(backend, hang_after=hang, device_fault_after=fault)
        self.engine = StepEngine(
            backend,
            programs,
            on_done=self._on_done,
            depth=spec.depth,
            # Serial mode: one step on the device at a time, answered before the next.
            max_inflight=8 if spec.pipeline else 1,
            pipeline=spec.pipeline,
            records_first=spec.record_order == "before-replay",
        )
        self.engine.start()  # this process's main thread issues (see _issue)
        self.ctx: zmq.Context[Any] = zmq.Context()
        affinity.free_io_threads(self.ctx)  # a pinned worker's sockets do I/O on every core
        self.auth: Any = None
        # Roles apply with CurveZMQ only; then each message's sender is noted (WorkerLoop).
        self.roles = spec.roles if spec.keys is not None else None
        self.sock = self.ctx.socket(zmq.ROUTER)
        if spec.keys is not None:
            self.auth = security.start_authenticator(self.ctx, spec.keys)
            spec.keys.apply(self.sock)
        self.sock.setsockopt(zmq.LINGER, 0)
        # A frame over this cuts the peer's connection unanswered; under it, a message
        # over the limits is answered TOO_LARGE (see protocol/admission.py).
        self.sock.setsockopt(zmq.MAXMSGSIZE, spec.limits.max_message_bytes)
        try:
            security.bind(self.sock, spec.endpoint)  # an ipc socket: its owner's only
        except zmq.ZMQError as exc:
            self.sock.close(linger=0)
            raise RuntimeError(
                f"cannot listen on {spec.endpoint}: {exc} (device {spec.device}'s worker: "
                "workers use the daemon's listen port + 1 + device id)"
            ) from None
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.draining = False
        self.metrics = WorkerMetrics()
        self._stateful = any(p.state_ops for p in programs)
        # Connections whose request changing device state was not applied: routing id ->
        # (that request's id, why). Their requests to stateful programs are refused until
        # they send resume (see _fence and docs/programs.md, "Ordering and retries"); an
        # entry goes with its connection (_peer_gone), so there is one per open connection
        # at most, and none is forgotten to make room.
        self._fences: dict[bytes, tuple[int, str]] = {}
        self.connections = Connections(self.sock, self._peer_gone) if self._stateful else None
        # Programs that keep clients' sequences: a client's go when it does (owners.py).
        self._sequence_programs = [p for p in programs if p.sequence_ops]
        self.owners = (
            SequenceOwners(self.connections, spec.sequence_grace_s, self._release)
            if self._sequence_programs
            else None
        )
        self.loop = WorkerLoop(
            self.sock,
            wire.Codec(spec.limits),
            self,
            pump=self._pump,
            metrics=self.metrics,
            # With CURVE, every message's sender key is noted: roles check it, and it
            # owns the sequences it adds (Job.owner).
            roles=spec.keys is not None,
            connections=self.connections,
            max_unread_bytes=spec.max_unread_reply_bytes,
            spin_s=spec.idle_spin_us * 1e-6,
            idle=self._idle,
        )
        self.responder = self.loop.responder
        # Accepted requests not answered yet (waiting + on the device), oldest first.
        self._open: dict[Job, None] = {}
        # When the last device request was answered (perf_counter): with requests open,
        # the time since then (or since the oldest was received) is how long the device
        # has made no progress, what the daemon's hang check reads (``stalled_s``).
        self._progress_at = time.perf_counter()
        self.started = time.time()
        self.exit_code = 0
        self._stop_when_idle = False
        # Accepted steps waiting for one of the engine's in-flight permits (bounded).
        self._waiting: collections.deque[Job] = collections.deque()
        self._main = threading.get_ident()

    @property
    def inflight(self) -> int:
        """Accepted requests not answered yet (waiting + on the device)."""
        return len(self._open)

    def info(self) -> dict[str, Any]:
        return {
            "device": self.spec.device,
            "pid": os.getpid(),
            "endpoint": self.endpoint,
            "generation": self.spec.generation,
            "backend": self.spec.backend,
            **({"sim_extensions": self.sim_extensions} if self.sim_extensions else {}),
            "programs": {name: self._describe(p) for name, p in self.engine.programs.items()},
            "depth": self.spec.depth,
            "pipeline": self.spec.pipeline,
            "cpus": list(self.spec.cpus) if self.spec.cpus else None,
        }

    def _describe(self, program: GraphProgram) -> dict[str, Any]:
        """A program's description, with each bucket's graph profile when the backend
        can tell what its graphs cost on the device (the sim)."""
        profiles = self.engine.graph_profiles(program.name)
        return {**program.describe(), **({"graph_profiles": profiles} if profiles else {})}

    def status(self) -> dict[str, Any]:
        now = time.perf_counter()
        oldest = next(iter(self._open)).received if self._open else now
        return {
            **self.info(),
            "state": "draining" if self.draining else "ready",
            "inflight": self.inflight,
            "queued": len(self._waiting),
            "steps": self.engine.jobs_done,
            "failure": str(self.engine.failure) if self.engine.failure else None,
            "counters": dict(self.responder.counters),
            "fenced": len(self._fences),  # connections refused until they send resume
            **self._sequence_status(),
            "oldest_inflight_s": round(now - oldest, 3) if self._open else 0.0,
            "stalled_s": round(now - max(oldest, self._progress_at), 3) if self._open else 0.0,
            "metrics": self.metrics.snapshot(),
            # Replies sent that libzmq still holds, over every connection (docs/security.md).
            "unread_reply_bytes": self.loop.unread.total(),
            "memory_releases": self.loop.freed.trims,
            "uptime_s": round(time.time() - self.started, 3),
        }

    def _sequence_status(self) -> dict[str, Any]:
        """What the worker keeps of its clients' sequences (docs/api.md, worker_status)."""
        if self.owners is None:
            return {}
        return {
            "sequences": {p.name: p.sequence_counts() for p in self._sequence_programs},
            # keys whose last connection went, their sequences kept for sequence_grace_s
            "sequence_clients_leaving": len(self.owners.pending),
        }

    # ------------------------------------------------------------ lifecycle
    def run(self) -> int:
        self._main = threading.get_ident()
        pipe.send(self.conn, pipe.Ready(self.info()))
        threading.Thread(target=self._lifeline, name="graphlane-lifeline", daemon=True).start()
        try:
            self.loop.serve()
        finally:
            self.engine.close()
            if self.connections is not None:
                self.connections.close()
            # Replies already queued (the last answers before a stop or a fault) go out.
            self.sock.close(linger=2000)
            if self.auth is not None:
                self.auth.stop()
            self.ctx.destroy(linger=0)
            self.loop.close()
        return self.exit_code

    def _lifeline(self) -> None:
        """Commands from the orchestrator, run on the main thread; EOF means it died:
        exit, do not linger as an orphan."""
        while True:
            try:
                cmd = pipe.recv(self.conn)
            except (EOFError, OSError):
                os._exit(4)
            except ValueError:
                log.error("ignored an unreadable message from the orchestrator")
                continue
            if isinstance(cmd, pipe.Finish):
                self.loop.post(functools.partial(self._begin_drain, cmd.stop))
            elif isinstance(cmd, pipe.Ping):
                # Answered by the main thread: the status is its state, and a loop that
                # cannot answer is a hung worker.
                self.loop.post(self._pong)

    def _pong(self) -> None:
        try:
            pipe.send(self.conn, pipe.Pong(self.status()))
        except OSError:
            os._exit(4)

    def _begin_drain(self, stop: bool) -> None:
        self.draining = True
        if stop:
            self._stop_when_idle = True
            self._maybe_stop()

    def _maybe_stop(self) -> None:
        if self._stop_when_idle and self.inflight == 0:
            self.loop.stopping = True

    # ------------------------------------------------------------ the loop's handler
    def refused(self, error: wire.DecodeError, origin: Origin) -> None:
        """A state change whose body did not decode (which program it meant is unknown:
        any of them) was not applied: what this connection sent behind it is refused."""
        if error.op in _CHANGES_STATE and self._stateful and error.request_id is not None:
            self._fence(origin.ident, origin.source, error.request_id, str(error.code))

    def answer(self, req: wire.Request, origin: Origin) -> Any:
        """The reply body of a request that is not device work; a device request's step
        issued or queued (LATER: answered when it finishes, see _finish)."""
        body = req.body
        if not ops.OPS[req.op].device:
            if self.roles is not None:
                self.roles.check(origin.sender, req.op)  # FORBIDDEN: drain, shutdown
            return self._control(body)
        if type(body) is ops.Resume:
            return self._resume(origin.ident, body)
        if type(body) is ops.AppendBlocks or type(body) is ops.Free:
            return self._sequence_change(req.op, body, origin)
        try:
            self._accept(req, body, origin)
        except Exception as exc:
            # A state change refused: what this connection sent behind it is refused too.
            # (STATE_LOST is a fence of its own; PREDECESSOR_FAILED: fenced already.)
            if (
                req.op in _CHANGES_STATE
                and self._keeps_state(body.program)
                and not isinstance(exc, StateLost | PredecessorFailed)
            ):
                self._fence(origin.ident, origin.source, req.id, str(as_error(exc).code))
            raise
        return LATER

    def _accept(self, req: wire.Request, body: Any, origin: Origin) -> None:
        """Validate a device request and issue or queue its step."""
        ident = origin.ident
        if self.roles is not None:  # FORBIDDEN: a program that does not serve this key
            self.roles.check(origin.sender, req.op, body.program)
        if self.draining:
            raise ShuttingDown(f"device {self.spec.device} is draining")
        if self.loop.unread.peers and (unread := self.loop.unread.refusal(ident)) is not None:
            raise Busy(unread)  # (its replies unread: WorkerLoop.unread)
        if body.device != self.spec.device:
            raise UnknownDevice(f"this worker serves device {self.spec.device}, not {body.device}")
        if body.program not in self.engine.programs:
            raise UnknownProgram(
                f"{body.program!r} is not served (serving {sorted(self.engine.programs)})"
            )
        if self.engine.failure is not None:
            raise InternalError(f"engine failed: {self.engine.failure}")
        if body.generation != self.spec.generation:  # None too: is it required?
            self._check_generation(body)
        if self._fences and ident in self._fences and self._keeps_state(body.program):
            raise self._refusal(*self._fences[ident])
        # Whose sequences it names: a client key names one client across its
        # connections; without CURVE, the connection is the client.
        owner = origin.sender if origin.sender is not None else ident
        if (
            self.owners is not None
            and self.engine.programs[body.program].sequence_ops
            and not self.owners.note(owner, ident, origin.source)
        ):
            raise BadRequest("this connection has closed: its sequences are released")
        job = self._job_of(body, req.op, owner)
        job.ident, job.request_id, job.bundled = ident, req.id, origin.bundled
        job.source = origin.source
        job.owner = owner
        job.received = received = origin.received
        job.changes_state = req.op in _CHANGES_STATE and self._stateful
        if body.timeout_ms is not None:
            job.deadline = received + body.timeout_ms / 1000
        if self._waiting or not self.engine.reserve(blocking=False):
            if len(self._waiting) >= self.spec.max_queued:
                raise Busy(f"{self.spec.max_queued} requests are queued already")
            self._open[job] = None
            self._waiting.append(job)
            return
        self._open[job] = None
        self._issue(job)

    def _sequence_change(self, op: str, body: Any, origin: Origin) -> dict[str, Any]:
        """append_blocks, free: the worker's record of the sender's sequences changes now
        (steps accepted before are planned already: in order with them)."""
        if self.roles is not None:
            self.roles.check(origin.sender, op, body.program)
        if body.device != self.spec.device:
            raise UnknownDevice(f"this worker serves device {self.spec.device}, not {body.device}")
        program = self.engine.programs.get(body.program)
        if program is None:
            raise UnknownProgram(
                f"{body.program!r} is not served (serving {sorted(self.engine.programs)})"
            )
        if body.generation != self.spec.generation:
            self._check_generation(body)
        owner = origin.sender if origin.sender is not None else origin.ident
        fields = {f: getattr(body, f) for f in body.__struct_fields__}
        try:
            return program.sequence_change(op, fields, owner)
        except StepError as exc:
            raise BadRequest(str(exc)) from exc

    def _control(self, body: Any) -> dict[str, Any]:
        """The answer to a request that is not device work."""
        if isinstance(body, ops.Hello):
            return {"version": wire.PROTOCOL_VERSION, **self.info()}
        if isinstance(body, ops.Status):
            return self.status()
        if isinstance(body, ops.Drain):
            self.draining = True
            return {"state": "draining", "inflight": self.inflight}
        raise BadRequest("shutdown is an orchestrator operation; send it to the daemon's endpoint")

    # ------------------------------------------------------------ ordering (docs/programs.md)
    def _keeps_state(self, program: str) -> bool:
        p = self.engine.programs.get(program)
        return p is not None and bool(p.state_ops)

    def _fence(self, ident: bytes, source: Any, request_id: int, why: str) -> None:
        """Request ``request_id`` of connection ``ident`` (``source``: the routing-id
        Frame of one of its messages) would have changed device state and was not
        applied: refuse its requests to stateful programs, those waiting behind it now
        and those it sends until it sends ``resume`` (or goes: _peer_gone)."""
        fence = self._fences.get(ident)
        if fence is None:  # the first failure is the one to send again
            fence = (request_id, why)
            # Kept while the connection is open (it cannot be forgotten before).
            if self.connections is None or self.connections.watch(ident, source):
                self._fences[ident] = fence
        waiting = self._waiting
        if not waiting:
            return
        behind = [s for s in waiting if s.ident == ident and self._keeps_state(s.plan.program)]
        if behind:
            refused = {id(s) for s in behind}
            kept = [s for s in waiting if id(s) not in refused]
            waiting.clear()
            waiting.extend(kept)
            refusal = self._refusal(*fence)
            for job in behind:
                self._open.pop(job, None)
                self.responder.fail(job.ident, job.request_id, refusal, job.bundled)

    def _peer_gone(self, ident: bytes) -> None:
        """Connection ``ident`` closed: what the worker keeps for it goes too (so it
        keeps state for open connections only). Called by self.connections."""
        self._fences.pop(ident, None)
        if self.owners is not None:
            self.owners.gone(ident)

    def _release(self, owner: Any) -> None:
        """``owner``'s last connection went (and its grace passed, for a key): every
        program forgets its sequences; its steps still waiting are dropped unrun (they
        would leave records behind; nobody is there to answer)."""
        released = sum(p.release(owner) for p in self._sequence_programs)
        if released:
            self.metrics.sequences_released += released
            self.metrics.clients_released += 1
        mine = [s for s in self._waiting if s.owner == owner]
        if mine:
            kept = [s for s in self._waiting if s.owner != owner]
            self._waiting.clear()
            self._waiting.extend(kept)
            for job in mine:
                self._open.pop(job, None)
        if released:
            log.info("a client went: its %d sequences are released", released)

    def _refusal(self, request_id: int, why: str) -> PredecessorFailed:
        return PredecessorFailed(
            f"request {request_id} of this connection ({why}) changes device state on "
            f"device {self.spec.device} and was not applied, so this request was not run; "
            f"send resume, then request {request_id} again, then this one"
        )

    def _resume(self, ident: bytes, body: Any) -> dict[str, Any]:
        if body.device != self.spec.device:
            raise UnknownDevice(f"this worker serves device {self.spec.device}, not {body.device}")
        fence = self._fences.pop(ident, None)
        return {"resumed": fence[0] if fence is not None else None}

    def _check_generation(self, body: Any) -> None:
        """A request naming another generation is refused (STATE_LOST); one that depends
        on device state (a program with state_ops) must name it."""
        expected = body.generation
        if expected is None:
            if self.engine.programs[body.program].state_ops:
                raise BadRequest(
                    f"body.generation is required: program {body.program!r} keeps device "
                    f"state (the worker's generation is in hello: {self.spec.generation})"
                )
        elif expected != self.spec.generation:
            raise StateLost(
                f"device {self.spec.device}'s worker is generation {self.spec.generation}, "
                f"not {expected}: it restarted and its device state is gone; write it again "
                f"and name generation {self.spec.generation}"
            )

    def _job_of(self, body: Any, op: str, owner: Any = None) -> Job:
        """The step a device request's body asks for, validated (BAD_REQUEST if not)."""
        try:
            if type(body) is ops.Step:  # the common case first
                outputs = tuple(body.outputs)
                return Job(JobKind.STEP, self.engine.plan(body, outputs), outputs)
            if type(body) is ops.Decode:
                outputs = tuple(body.outputs) or ("tokens",)
                fields = {"sequences": body.sequences, "new_blocks": body.new_blocks}
                plan = self.engine.plan_sequences(body.program, op, fields, owner, outputs)
                return Job(JobKind.STEP, plan, outputs)
            if type(body) is ops.AddSequence:
                fields = {f: getattr(body, f) for f in body.__struct_fields__}
                plan = self.engine.plan_sequences(body.program, op, fields, owner, body.outputs)
                return Job(JobKind.STATE, plan)
            if type(body) is ops.KvWrite:
                fields = {"slots": body.slots, "key": body.key, "value": body.value}
                return Job(JobKind.STATE, self.engine.plan_state(body.program, op, fields))
            if type(body) is ops.KvRead:
                fields = {"slots": body.slots}
                return Job(JobKind.STATE, self.engine.plan_state(body.program, op, fields))
            if type(body) is ops.Prefill:
                fields = {f: getattr(body, f) for f in body.__struct_fields__}
                return Job(JobKind.STATE, self.engine.plan_state(body.program, op, fields))
            if type(body) is ops.Update:
                return Job(JobKind.UPDATE, self.engine.plan_update(body))
            outputs = tuple(body.outputs)
            plan = self.engine.plan_replay(body.program, body.batch, outputs)
            return Job(JobKind.REPLAY, plan, outputs)
        except StepError as exc:
            raise BadRequest(str(exc)) from exc

    def _idle(self) -> bool:
        """Every accepted request is answered: none waits, none is on the device, and no
        engine thread has a completion to post (WorkerLoop's poll holds the lock they
        would need). A request leaves ``_open`` when it is answered, after its permit
        came back, or unissued."""
        return not self._open

    def _pump(self) -> None:
        """Issue waiting steps while the engine has in-flight permits; a step whose caller's
        deadline (``timeout_ms``) passed while it waited is answered TIMEOUT unrun."""
        if self.owners is not None and self.owners.pending:
            self.owners.release_due()
        waiting = self._waiting
        while waiting:
            job = waiting[0]
            if job.deadline is not None and time.perf_counter() > job.deadline:
                waiting.popleft()
                self._open.pop(job, None)
                late = Timeout(f"{job.kind.value} waited past its deadline; it was not run")
                self.responder.fail(job.ident, job.request_id, late, job.bundled)
                if job.changes_state and self._keeps_state(job.plan.program):
                    self._fence(job.ident, job.source, job.request_id, "TIMEOUT")
                continue
            if not self.engine.reserve(blocking=False):
                return
            self._issue(waiting.popleft())

    def _issue(self, job: Job) -> None:
        """Issue an accepted step on the device (a group's leader forwards it first)."""
        self.engine.issue(job)

    def _on_done(self, job: Job) -> None:
        """The engine's completion callback (see StepEngine.issue)."""
        if threading.get_ident() == self._main:  # completed on the spot, during its issue
            self._finish(job)
        else:  # from the completion thread
            self.loop.post(functools.partial(self._finish, job))

    def _finish(self, job: Job) -> None:
        self._open.pop(job, None)
        self._progress_at = now = time.perf_counter()
        if job.results is None:
            error = as_error(job.error or InternalError("step ended without results"))
            self.responder.fail(job.ident, job.request_id, error, job.bundled)
            if job.changes_state and self._keeps_state(job.plan.program):
                self._fence(job.ident, job.source, job.request_id, str(error.code))
        else:
            held = now - job.received
            self.metrics.observe_done(
                job.plan.program,
                job.kind._value_,
                held,
                job.dispatch_s,
                job.replay_at,
                job.done_at,
            )
            # A device-state operation runs on no graph instance: bucket and instance 0.
            key = job.graph.key if job.graph is not None else _NO_GRAPH
            done = ops.DeviceResult(
                job.results,
                key.bucket,
                key.instance,
                job.patched,
                held * 1e6,  # the time it held the request, decode to reply, device work in
                self.spec.generation,
            )
            self.responder.reply(job.ident, job.request_id, done, job.bundled)
        if self.engine.failure is not None and not self.loop.stopping:
            # A device fault: this process cannot serve again. Answer what waits,
            # then exit; the orchestrator restarts the worker, which captures afresh.
            log.error("device fault, worker exits: %s", self.engine.failure)
            failed = InternalError(f"engine failed: {self.engine.failure}")
            while self._waiting:
                waiting = self._waiting.popleft()
                self._open.pop(waiting, None)
                self.responder.fail(waiting.ident, waiting.request_id, failed, waiting.bundled)
            self.exit_code = 5
            self.loop.stopping = True
            return
        self._maybe_stop()


_NO_GRAPH = GraphKey("", 0, 0)
#: Ops whose failure leaves a stateful program's device state without what the client
#: meant to put there (a kv_write's KV, a prefill's prompt, a step's new token).
_CHANGES_STATE = frozenset({"kv_write", "prefill", "step", "add", "decode"})

__all__ = ["Worker", "WorkerSpec", "start_failure", "worker_main"]
