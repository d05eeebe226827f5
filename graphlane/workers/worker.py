"""The worker process: one per device.

Threads and their roles:

- the main thread runs an asyncio loop that owns the worker's ROUTER socket:
  it decodes requests, validates them and queues them on the step engine, and
  sends every reply (replies come back from the engine's completion thread
  through ``loop.call_soon_threadsafe``);
- the engine's issue thread owns the device's streams; its completion thread
  waits for finished steps (see :mod:`graphlane.workers.pipeline`);
- the *lifeline* thread reads the pipe to the orchestrator: commands (drain,
  stop, ping) and, when the orchestrator dies, end-of-file, on which the worker
  exits at once so that no orphan keeps the device.

Startup handshake: the worker captures its programs, binds its socket, then
sends ``("ready", info)`` on the pipe (or ``("failed", message)``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import zmq
import zmq.asyncio

from graphlane.logs import Throttled, setup_logging
from graphlane.protocol import codec, messages, security
from graphlane.protocol.errors import (
    BadRequest,
    Busy,
    GraphlaneError,
    InternalError,
    ShuttingDown,
    UnknownDevice,
    UnknownProgram,
)
from graphlane.workers.metrics import WorkerMetrics
from graphlane.workers.pipeline import EngineBusy, EngineError, StepEngine, StepRequest, StepResult
from graphlane.workers.programs import StepError

log = logging.getLogger("graphlane.worker")


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs; built by the orchestrator, sent at spawn."""

    device: int
    backend: str = "sim"
    sim: Any = None  # graphlane.workers.sim.SimConfig for backend "sim"
    programs: tuple[dict[str, Any], ...] = ({"name": "attention"},)
    depth: int = 1
    pipeline: bool = True
    endpoint: str = "tcp://127.0.0.1:0"
    max_queued: int = 256
    limits: codec.Limits = field(default_factory=codec.Limits)
    generation: int = 0
    log_level: int = logging.INFO
    log_format: str = "text"
    auth_dir: str | None = None  # CurveZMQ server keys and admitted clients
    # Fault injection for tests: "fail_start": true, "hang_device_after": N,
    # "device_fault_after": N.
    faults: dict[str, Any] = field(default_factory=dict)


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Process entry point (spawn)."""
    setup_logging(spec.log_level, spec.log_format, f"worker[{spec.device}]")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the orchestrator decides when workers stop
    try:
        worker = Worker(spec, conn)
    except BaseException as exc:  # report the failure through the handshake, then exit
        try:
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        finally:
            os._exit(3)
    code = worker.run()
    os._exit(code)


class Worker:
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
        programs = [load_program(str(p["name"]), p) for p in spec.programs]
        self.engine = StepEngine(
            backend, programs, depth=spec.depth, pipeline=spec.pipeline, max_queued=spec.max_queued
        )
        self.engine.fault_hang_after = spec.faults.get("hang_device_after")
        self.engine.fault_device_after = spec.faults.get("device_fault_after")
        self.engine.start()
        self.ctx = zmq.asyncio.Context()
        self.auth: Any = None
        self.sock = self.ctx.socket(zmq.ROUTER)
        if spec.auth_dir is not None:
            keys = security.ServerKeys.load(spec.auth_dir)
            self.auth = security.start_authenticator(self.ctx, keys)
            keys.apply(self.sock)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, spec.limits.max_message_bytes)
        self.sock.bind(spec.endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.draining = False
        self.inflight = 0
        self.counters = {"requests": 0, "replies": 0, "errors": 0, "undecodable": 0}
        self.metrics = WorkerMetrics()
        self._dropped_log = Throttled(log)
        self._inflight_since: dict[int, float] = {}  # token -> when the request arrived
        self._tokens = 0
        self.started = time.time()
        self._stop = asyncio.Event()
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def info(self) -> dict[str, Any]:
        return {
            "device": self.spec.device,
            "pid": os.getpid(),
            "endpoint": self.endpoint,
            "generation": self.spec.generation,
            "backend": self.spec.backend,
            "programs": {
                name: {
                    "buckets": list(p.buckets),
                    "outputs": list(p.outputs),
                    "groups": p.num_groups,
                }
                for name, p in self.engine.programs.items()
            },
            "depth": self.spec.depth,
            "pipeline": self.spec.pipeline,
        }

    def status(self) -> dict[str, Any]:
        return {
            **self.info(),
            "state": "draining" if self.draining else "ready",
            "inflight": self.inflight,
            "queued": self.engine.queued,
            "steps": self.engine.steps_done,
            "failure": str(self.engine.failure) if self.engine.failure else None,
            "counters": dict(self.counters),
            "oldest_inflight_s": round(time.perf_counter() - min(self._inflight_since.values()), 3)
            if self._inflight_since
            else 0.0,
            "metrics": self.metrics.snapshot(),
            "uptime_s": round(time.time() - self.started, 3),
        }

    # ------------------------------------------------------------ lifecycle
    def run(self) -> int:
        self.conn.send(("ready", self.info()))
        threading.Thread(target=self._lifeline, name="graphlane-lifeline", daemon=True).start()
        try:
            asyncio.run(self._serve())
        finally:
            self.engine.close()
            # Replies already queued (the last answers before a stop or a fault) go out.
            self.sock.close(linger=2000)
            if self.auth is not None:
                self.auth.stop()
            self.ctx.term()
        return self.exit_code

    def _lifeline(self) -> None:
        """Commands from the orchestrator; EOF means it died: exit, do not linger as an orphan."""
        while True:
            try:
                cmd = self.conn.recv()
            except (EOFError, OSError):
                os._exit(4)
            if cmd == "drain" or cmd == "stop":
                loop = self._loop
                if loop is not None:
                    loop.call_soon_threadsafe(self._begin_drain, cmd == "stop")
            elif cmd == "ping":
                # Answered by the loop thread: the status is its state, and a loop that
                # cannot answer is a hung worker.
                loop = self._loop
                if loop is not None:
                    loop.call_soon_threadsafe(self._pong)

    def _pong(self) -> None:
        try:
            self.conn.send(("pong", self.status()))
        except OSError:
            os._exit(4)

    def _begin_drain(self, stop: bool) -> None:
        self.draining = True
        if stop:
            self._stop_when_idle = True
            self._maybe_stop()

    _stop_when_idle = False

    def _maybe_stop(self) -> None:
        if self._stop_when_idle and self.inflight == 0:
            self._stop.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        recv = asyncio.ensure_future(self._recv_loop())
        await self._stop.wait()
        recv.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await recv

    async def _recv_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            self._handle(frames)

    # ------------------------------------------------------------ requests
    def _send(self, ident: Any, frames: list[Any]) -> None:
        self.metrics.bytes_out += sum(memoryview(f).nbytes for f in frames)
        self.sock.send_multipart([ident, *frames], copy=False)

    def _reply_error(self, ident: Any, request_id: int, error: GraphlaneError) -> None:
        self.counters["errors"] += 1
        self.metrics.errors[str(error.code)] += 1
        self._send(ident, codec.encode_error(request_id, error))

    def _handle(self, frames: list[Any]) -> None:
        received = time.perf_counter()
        self.counters["requests"] += 1
        self.metrics.bytes_in += sum(len(f) for f in frames[1:])
        ident = frames[0]
        try:
            req = codec.decode_request(frames[1:], self.spec.limits)
        except codec.DecodeError as exc:
            if exc.request_id is None:
                self.counters["undecodable"] += 1
                self._dropped_log.warning("dropped an undecodable message: %s", exc.message)
                return
            self._reply_error(ident, exc.request_id, exc.to_error())
            return
        try:
            self._dispatch(ident, req, received)
        except GraphlaneError as exc:
            self._reply_error(ident, req.id, exc)
        except Exception as exc:  # never let one request take the worker down
            log.exception("request %s (%s) failed", req.id, req.op)
            self._reply_error(ident, req.id, InternalError(f"{type(exc).__name__}: {exc}"))

    def _dispatch(self, ident: Any, req: codec.Request, received: float) -> None:
        msg = messages.parse_body(req.op, req.body)
        if isinstance(msg, messages.Hello):
            self._send(
                ident,
                codec.encode_reply(req.id, {"version": codec.PROTOCOL_VERSION, **self.info()}),
            )
            return
        if isinstance(msg, messages.StatusRequest):
            self._send(ident, codec.encode_reply(req.id, self.status()))
            return
        if isinstance(msg, messages.DrainRequest):
            self.draining = True
            self._send(
                ident, codec.encode_reply(req.id, {"state": "draining", "inflight": self.inflight})
            )
            return
        if isinstance(msg, messages.ShutdownRequest):
            raise BadRequest(
                "shutdown is an orchestrator operation; send it to the daemon's endpoint"
            )
        if self.draining:
            raise ShuttingDown(f"device {self.spec.device} is draining")
        if msg.device != self.spec.device:
            raise UnknownDevice(f"this worker serves device {self.spec.device}, not {msg.device}")
        if msg.program not in self.engine.programs:
            raise UnknownProgram(
                f"{msg.program!r} is not served (serving {sorted(self.engine.programs)})"
            )
        fut = self._submit(msg)
        self.inflight += 1
        self._tokens += 1
        token = self._tokens
        self._inflight_since[token] = received
        loop = self._loop
        assert loop is not None
        where = (msg.program, req.op, token)
        fut.add_done_callback(
            lambda f: loop.call_soon_threadsafe(self._finish, ident, req.id, f, received, where)
        )

    def _submit(self, msg: Any) -> Future[StepResult]:
        try:
            if isinstance(msg, messages.ReplayRequestMsg):
                return self.engine.submit_replay(msg.program, msg.batch, tuple(msg.outputs))
            request = StepRequest(
                msg.program,
                msg.batch,
                msg.params,
                msg.inputs,
                tuple(getattr(msg, "outputs", ())),
            )
            if isinstance(msg, messages.UpdateRequestMsg):
                return self.engine.submit_update(request)
            return self.engine.submit(request)
        except StepError as exc:
            raise BadRequest(str(exc)) from exc
        except EngineBusy as exc:
            raise Busy(str(exc)) from exc
        except EngineError as exc:
            raise InternalError(str(exc)) from exc

    def _finish(
        self,
        ident: Any,
        request_id: int,
        fut: Future[StepResult],
        received: float,
        where: tuple[str, str, int],
    ) -> None:
        program, op, token = where
        self.inflight -= 1
        self._inflight_since.pop(token, None)
        exc = fut.exception()
        if exc is not None:
            error = (
                exc
                if isinstance(exc, GraphlaneError)
                else InternalError(f"{type(exc).__name__}: {exc}")
            )
            self._reply_error(ident, request_id, error)
        else:
            r = fut.result()
            now = time.perf_counter()
            self.metrics.observe_step(program, op, now - received)
            if r.dispatch_s:
                self.metrics.dispatch_seconds.observe(r.dispatch_s)
            if r.replay_at:
                self.metrics.replay_seconds.observe(max(0.0, r.done_at - r.replay_at))
            body = {
                "outputs": r.outputs,
                "bucket": r.key.bucket,
                "slot": r.key.slot,
                "patched": r.patched_groups,
                # Time the worker held the request: decode to reply (device work included).
                "server_us": round((now - received) * 1e6, 1),
            }
            self.counters["replies"] += 1
            self._send(ident, codec.encode_reply(request_id, body))
        if self.engine.failure is not None and not self._stop.is_set():
            # A device fault: this process cannot serve again. Exit; the
            # orchestrator restarts the worker, which captures afresh.
            log.error("device fault, worker exits: %s", self.engine.failure)
            self.exit_code = 5
            self._stop.set()
            return
        self._maybe_stop()


__all__ = ["Worker", "WorkerSpec", "worker_main"]
