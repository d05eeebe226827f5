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
sends ``pipe.Ready(info)`` on the pipe (or ``pipe.Failed(message)``).

The socket loop, the replies and the lifeline are :class:`~.loop.WorkerLoop`'s,
the Worker's base; the Worker does what requests ask of the device.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import zmq

from graphlane.logs import Throttled, setup_logging
from graphlane.protocol import ops, pipe, security, wire
from graphlane.protocol.errors import (
    BadRequest,
    Busy,
    InternalError,
    ShuttingDown,
    StateLost,
    Timeout,
    UnknownDevice,
    UnknownProgram,
    as_error,
)
from graphlane.workers import affinity
from graphlane.workers.engine import StepEngine
from graphlane.workers.loop import WorkerLoop
from graphlane.workers.memory import keep_freed_buffers
from graphlane.workers.metrics import WorkerMetrics
from graphlane.workers.programs import StepError
from graphlane.workers.programs.base import GraphKey
from graphlane.workers.step import OpKind, Step

log = logging.getLogger("graphlane.worker")


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs; built by the orchestrator, sent at spawn."""

    device: int
    backend: str = "sim"
    sim: dict[str, Any] | None = None  # backend "sim": the fields of graphlane.sim.SimConfig
    programs: tuple[dict[str, Any], ...] = ({"name": "attention"},)
    depth: int = 2  # the config's default (see ServeConfig.depth)
    pipeline: bool = True
    endpoint: str = "tcp://127.0.0.1:0"
    max_queued: int = 256
    limits: wire.Limits = field(default_factory=wire.Limits)
    generation: int = 0
    log_level: int = logging.INFO
    log_format: str = "text"
    auth_dir: str | None = None  # CurveZMQ server keys and admitted clients
    # Fault injection for tests: "fail_start": true, "hang_device_after": N,
    # "device_fault_after": N.
    faults: dict[str, Any] = field(default_factory=dict)
    cpus: tuple[int, ...] | None = None  # the cores its threads run on (None: any; affinity.py)


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Process entry point (spawn)."""
    setup_logging(spec.log_level, spec.log_format, f"worker[{spec.device}]")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the orchestrator decides when workers stop
    keep_freed_buffers()  # large inputs reuse mapped pages, step after step (see memory.py)
    try:
        affinity.pin(spec.cpus)  # before any thread starts: they all inherit it
        worker = Worker(spec, conn)
    except BaseException as exc:  # report the failure through the handshake, then exit
        try:
            pipe.send(conn, pipe.Failed(f"{type(exc).__name__}: {exc}"))
        finally:
            os._exit(3)
    code = worker.run()
    os._exit(code)


class Worker(WorkerLoop):
    def __init__(self, spec: WorkerSpec, conn: Connection) -> None:
        from graphlane.workers.backends import create_backend
        from graphlane.workers.programs import load_program

        self.spec = spec
        self.conn = conn
        if spec.faults.get("fail_start"):
            raise RuntimeError("fault injection: fail_start")
        options: dict[str, Any] = {}
        if spec.backend == "sim" and spec.sim is not None:
            options["config"] = spec.sim
        backend = create_backend(spec.backend, spec.device, **options)
        hang, fault = spec.faults.get("hang_device_after"), spec.faults.get("device_fault_after")
        if hang is not None or fault is not None:  # tests: a device that misbehaves on cue
            from graphlane.workers.backends.faults import FaultyBackend

            backend = FaultyBackend(backend, hang_after=hang, device_fault_after=fault)
        programs = [load_program(str(p["name"]), p) for p in spec.programs]
        self.engine = StepEngine(
            backend,
            programs,
            on_done=self._on_done,
            depth=spec.depth,
            # Serial mode: one step on the device at a time, answered before the next.
            max_inflight=8 if spec.pipeline else 1,
            pipeline=spec.pipeline,
        )
        self.engine.start()  # this process's main thread issues (see _issue)
        self.ctx: zmq.Context[Any] = zmq.Context()
        affinity.free_io_threads(self.ctx)  # a pinned worker's sockets do I/O on every core
        self.auth: Any = None
        self.sock = self.ctx.socket(zmq.ROUTER)
        if spec.auth_dir is not None:
            keys = security.ServerKeys.load(spec.auth_dir)
            self.auth = security.start_authenticator(self.ctx, keys)
            keys.apply(self.sock)
        self.sock.setsockopt(zmq.LINGER, 0)
        # A frame over this cuts the peer's connection unanswered; under it, a message
        # over the limits is answered TOO_LARGE (see protocol/admission.py).
        self.sock.setsockopt(zmq.MAXMSGSIZE, spec.limits.max_message_bytes)
        try:
            self.sock.bind(spec.endpoint)
        except zmq.ZMQError as exc:
            self.sock.close(linger=0)
            raise RuntimeError(
                f"cannot listen on {spec.endpoint}: {exc} (device {spec.device}'s worker: "
                "workers use the daemon's listen port + 1 + device id)"
            ) from None
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.draining = False
        self.counters = {"requests": 0, "replies": 0, "errors": 0, "undecodable": 0, "bundles": 0}
        self.metrics = WorkerMetrics()
        self._dropped_log = Throttled(log)
        self._failed_log = Throttled(log)
        # Accepted requests not answered yet (waiting + on the device), oldest first.
        self._open: dict[Step, None] = {}
        self.started = time.time()
        self.exit_code = 0
        self._stopping = False
        self._stop_when_idle = False
        # Accepted steps waiting for one of the engine's in-flight permits (bounded).
        self._waiting: collections.deque[Step] = collections.deque()
        # Filled by other threads, emptied by the main thread after a wake-up:
        # finished steps from the completion thread, commands from the lifeline.
        self._finished: collections.deque[Step] = collections.deque()
        self._commands: collections.deque[Callable[[], None]] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._woken = False  # a byte is (or is about to be) in the wake-up pipe
        self._main = threading.get_ident()
        # Replies to bundled requests waiting to go back as one bundle per sender:
        # the sender's routing id -> its reply envelopes; None when none is open.
        self._outbox: dict[bytes, list[bytes]] | None = None
        self._outbox_since = 0.0  # when the open outbox last went out (or opened)

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
            "programs": {name: p.describe() for name, p in self.engine.programs.items()},
            "depth": self.spec.depth,
            "pipeline": self.spec.pipeline,
            "cpus": list(self.spec.cpus) if self.spec.cpus else None,
        }

    def status(self) -> dict[str, Any]:
        return {
            **self.info(),
            "state": "draining" if self.draining else "ready",
            "inflight": self.inflight,
            "queued": len(self._waiting),
            "steps": self.engine.steps_done,
            "failure": str(self.engine.failure) if self.engine.failure else None,
            "counters": dict(self.counters),
            "oldest_inflight_s": round(time.perf_counter() - next(iter(self._open)).received, 3)
            if self._open
            else 0.0,
            "metrics": self.metrics.snapshot(),
            "uptime_s": round(time.time() - self.started, 3),
        }

    # ------------------------------------------------------------ lifecycle
    def run(self) -> int:
        self._main = threading.get_ident()
        pipe.send(self.conn, pipe.Ready(self.info()))
        threading.Thread(target=self._lifeline, name="graphlane-lifeline", daemon=True).start()
        try:
            self._serve()
        finally:
            self.engine.close()
            # Replies already queued (the last answers before a stop or a fault) go out.
            self.sock.close(linger=2000)
            if self.auth is not None:
                self.auth.stop()
            self.ctx.destroy(linger=0)
            os.close(self._wake_r)
            os.close(self._wake_w)
        return self.exit_code

    def _dispatch(self, ident: bytes, req: wire.Request, received: float, bundled: bool) -> None:
        op = ops.OPS.get(req.op) or ops.op_named(req.op)  # op_named: the unknown op's error
        body = req.body(op.request_decoder)
        if not op.device:
            self._control(ident, req.id, body, bundled)
            return
        if self.draining:
            raise ShuttingDown(f"device {self.spec.device} is draining")
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
        step = self._step(body, req.op)
        step.ident, step.request_id, step.bundled, step.received = ident, req.id, bundled, received
        if body.timeout_ms is not None:
            step.deadline = received + body.timeout_ms / 1000
        if self._waiting or not self.engine.reserve(blocking=False):
            if len(self._waiting) >= self.spec.max_queued:
                raise Busy(f"{self.spec.max_queued} requests are queued already")
            self._open[step] = None
            self._waiting.append(step)
            return
        self._open[step] = None
        self.engine.issue(step)

    def _control(self, ident: bytes, request_id: int, body: Any, bundled: bool) -> None:
        """Answer a request that is not device work."""
        if isinstance(body, ops.Hello):
            hello = {"version": wire.PROTOCOL_VERSION, **self.info()}
            self._send(ident, wire.encode_reply(request_id, hello), bundled)
        elif isinstance(body, ops.Status):
            self._send(ident, wire.encode_reply(request_id, self.status()), bundled)
        elif isinstance(body, ops.Drain):
            self.draining = True
            drained = {"state": "draining", "inflight": self.inflight}
            self._send(ident, wire.encode_reply(request_id, drained), bundled)
        else:
            raise BadRequest(
                "shutdown is an orchestrator operation; send it to the daemon's endpoint"
            )

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

    def _step(self, body: Any, op: str) -> Step:
        """The step a device request's body asks for, validated (BAD_REQUEST if not)."""
        try:
            if type(body) is ops.Step:  # the common case first
                outputs = tuple(body.outputs)
                return Step(OpKind.STEP, self.engine.plan(body, outputs), outputs)
            if type(body) is ops.KvWrite:
                fields = {"slots": body.slots, "key": body.key, "value": body.value}
                return Step(OpKind.STATE, self.engine.plan_state(body.program, op, fields))
            if type(body) is ops.KvRead:
                fields = {"slots": body.slots}
                return Step(OpKind.STATE, self.engine.plan_state(body.program, op, fields))
            if type(body) is ops.Update:
                return Step(OpKind.UPDATE, self.engine.plan(body))
            outputs = tuple(body.outputs)
            plan = self.engine.plan_replay(body.program, body.batch, outputs)
            return Step(OpKind.REPLAY, plan, outputs)
        except StepError as exc:
            raise BadRequest(str(exc)) from exc

    def _pump(self) -> None:
        """Issue waiting steps while the engine has in-flight permits; a step whose caller's
        deadline (``timeout_ms``) passed while it waited is answered TIMEOUT unrun."""
        waiting = self._waiting
        while waiting:
            step = waiting[0]
            if step.deadline is not None and time.perf_counter() > step.deadline:
                waiting.popleft()
                self._open.pop(step, None)
                late = Timeout(f"{step.kind.value} waited past its deadline; it was not run")
                self._reply_error(step.ident, step.request_id, late, step.bundled)
                continue
            if not self.engine.reserve(blocking=False):
                return
            self.engine.issue(waiting.popleft())

    def _on_done(self, step: Step) -> None:
        """The engine's completion callback (see StepEngine.issue)."""
        if threading.get_ident() == self._main:  # completed on the spot, during its issue
            self._finish(step)
        else:  # from the completion thread
            self._finished.append(step)
            self._wake()

    def _finish(self, step: Step) -> None:
        self._open.pop(step, None)
        if step.results is None:
            error = step.error or InternalError("step ended without results")
            self._reply_error(step.ident, step.request_id, as_error(error), step.bundled)
        else:
            held = time.perf_counter() - step.received
            self.metrics.observe_done(
                step.plan.program,
                step.kind._value_,
                held,
                step.dispatch_s,
                step.replay_at,
                step.done_at,
            )
            # A device-state operation runs on no graph instance: bucket and instance 0.
            key = step.graph.key if step.graph is not None else _NO_GRAPH
            try:
                frames = wire.encode_done(
                    step.request_id,
                    step.results,
                    key.bucket,
                    key.instance,
                    step.patched,
                    held * 1e6,  # the time it held the request, decode to reply, device work in
                    self.spec.generation,
                )
            except Exception as exc:  # a program's outputs that cannot be sent: say so
                log.exception("reply to request %s cannot be encoded", step.request_id)
                self._reply_error(
                    step.ident, step.request_id, InternalError(str(exc)), step.bundled
                )
            else:
                self.counters["replies"] += 1
                self._send(step.ident, frames, step.bundled)
        if self.engine.failure is not None and not self._stopping:
            # A device fault: this process cannot serve again. Answer what waits,
            # then exit; the orchestrator restarts the worker, which captures afresh.
            log.error("device fault, worker exits: %s", self.engine.failure)
            failed = InternalError(f"engine failed: {self.engine.failure}")
            while self._waiting:
                waiting = self._waiting.popleft()
                self._open.pop(waiting, None)
                self._reply_error(waiting.ident, waiting.request_id, failed, waiting.bundled)
            self.exit_code = 5
            self._stopping = True
            return
        self._maybe_stop()


_NO_GRAPH = GraphKey("", 0, 0)

__all__ = ["Worker", "WorkerSpec", "worker_main"]
