"""Spawns, watches and restarts the worker processes (one per device).

Lifecycle of a worker, explicit:

    spawn (multiprocessing "spawn") -> handshake: pipe.Ready(info) on its pipe within
    startup_timeout_s -> READY; liveness through the process sentinel (an fd that
    becomes readable when the process ends) -> LOST -> restart after a backoff,
    unless more than max_restarts happened within restart_window_s -> FAILED.
    stop: pipe.Drain(stop=True) (finish in-flight, exit) -> SIGTERM -> SIGKILL,
    recording which step ended it.

The pipe is also the worker's lifeline: when the orchestrator dies, the worker
reads EOF and exits, so no orphan keeps a device. Only the typed messages of
:mod:`graphlane.protocol.pipe` cross it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import multiprocessing as mp
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from graphlane.protocol import pipe
from graphlane.workers.worker import WorkerSpec, worker_main

log = logging.getLogger("graphlane.supervisor")

class WorkerState(enum.StrEnum):
    """Where a worker is in its lifecycle (the value is what status reports)."""

    STARTING = "starting"
    READY = "ready"
    LOST = "lost"
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"


STARTING, READY, LOST, FAILED, STOPPING, STOPPED = WorkerState


@dataclass(eq=False)
class WorkerHandle:
    spec: WorkerSpec
    state: WorkerState = STARTING
    process: BaseProcess | None = None
    conn: Connection | None = None
    info: dict[str, Any] = field(default_factory=dict)
    restarts: int = 0
    restart_times: deque[float] = field(default_factory=deque)
    generation: int = 0
    last_exit: int | None = None
    last_error: str = ""
    stopped_by: str = ""
    stats: dict[str, Any] = field(default_factory=dict)  # the worker's latest status report
    exited: asyncio.Event = field(default_factory=asyncio.Event)  # the current process ended

    @property
    def device(self) -> int:
        return self.spec.device

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def describe(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "pid": self.pid,
            "state": self.state,
            "restarts": self.restarts,
            "generation": self.generation,
            "endpoint": self.info.get("endpoint"),
            "programs": self.info.get("programs", {}),
            "cpus": list(self.spec.cpus) if self.spec.cpus else None,  # None: not pinned
            "last_exit": self.last_exit,
            "last_error": self.last_error or None,
        }


class Supervisor:
    def __init__(
        self,
        specs: list[WorkerSpec],
        *,
        startup_timeout_s: float = 120.0,
        max_restarts: int = 5,
        restart_window_s: float = 60.0,
        backoff_s: tuple[float, float] = (0.2, 10.0),
        hang_timeout_s: float = 30.0,
        poll_s: float = 1.0,
        env_for: Callable[[int], dict[str, str]] | None = None,
    ) -> None:
        # Each worker's first generation is its spec's (the daemon's, see daemon.py).
        self.workers = {s.device: WorkerHandle(s, generation=s.generation) for s in specs}
        self.startup_timeout_s = startup_timeout_s
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.backoff_s = backoff_s
        self.hang_timeout_s = hang_timeout_s
        self.poll_s = poll_s
        self.env_for = env_for or (lambda device: {})
        self.stopping = False
        self.all_failed = asyncio.Event()  # set when every worker is FAILED for good
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ctx = mp.get_context("spawn")

    # ------------------------------------------------------------ start
    async def start_all(self) -> None:
        await asyncio.gather(*(self._start(h) for h in self.workers.values()))

    async def _start(self, h: WorkerHandle) -> None:
        h.state = STARTING
        spec = replace(h.spec, generation=h.generation)
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=worker_main, args=(spec, child), name=f"graphlane-worker-{h.device}", daemon=True
        )
        env = self.env_for(h.device)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # a spawned child takes the parent's environment at start
        try:
            proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()
        h.process, h.conn = proc, parent
        h.exited = asyncio.Event()
        log.info("worker start device=%s pid=%s generation=%s", h.device, proc.pid, h.generation)
        loop = asyncio.get_running_loop()
        loop.add_reader(proc.sentinel, self._on_exit, h, proc)
        msg = await self._handshake(parent)
        if h.process is not proc or h.state != STARTING:
            return  # died (or was stopped) during startup; _on_exit took over
        if isinstance(msg, pipe.Ready):
            h.info = dict(msg.info)
            h.state = READY
            h.last_error = ""
            log.info(
                "worker ready device=%s pid=%s endpoint=%s",
                h.device,
                proc.pid,
                h.info.get("endpoint"),
            )
            self._spawn_task(self._watch(h, proc, parent))
            return
        h.last_error = (
            msg.message if msg is not None else f"no handshake within {self.startup_timeout_s:g} s"
        )
        log.error("worker failed to start device=%s pid=%s: %s", h.device, proc.pid, h.last_error)
        self._kill(proc)

    async def _receive(self, conn: Connection, limit_s: float) -> Any:
        """The next message on a worker's pipe, or None (timeout, EOF)."""
        loop = asyncio.get_running_loop()
        readable = asyncio.Event()
        loop.add_reader(conn.fileno(), readable.set)
        try:
            await asyncio.wait_for(readable.wait(), limit_s)
            return pipe.recv(conn)
        except (TimeoutError, EOFError, OSError, ValueError):
            return None
        finally:
            with contextlib.suppress(OSError, ValueError):
                loop.remove_reader(conn.fileno())

    async def _watch(self, h: WorkerHandle, proc: BaseProcess, conn: Connection) -> None:
        """Health and figures, about once per poll_s. A worker that does not answer, or
        holds a request longer than hang_timeout_s (a device wait that never ends),
        is killed; the normal restart path replaces it."""
        while True:
            await asyncio.sleep(self.poll_s)
            if h.process is not proc or h.state != READY or h.conn is not conn:
                return
            try:
                pipe.send(conn, pipe.Ping())
            except OSError:
                return
            msg = await self._receive(conn, self.hang_timeout_s)
            if h.process is not proc or h.state != READY:
                return
            if not isinstance(msg, pipe.Pong):
                self._hung(h, proc, f"no answer to a health check within {self.hang_timeout_s:g} s")
                return
            h.stats = msg.status
            age = float(h.stats.get("oldest_inflight_s", 0.0))
            if age > self.hang_timeout_s:
                self._hung(
                    h, proc, f"a request has been in flight for {age:.1f} s (hang_timeout_s)"
                )
                return

    def _hung(self, h: WorkerHandle, proc: BaseProcess, why: str) -> None:
        h.last_error = f"hung: {why}"
        log.error("worker hung device=%s pid=%s: %s; killing it", h.device, proc.pid, why)
        self._kill(proc)

    async def _handshake(self, conn: Connection) -> pipe.Ready | pipe.Failed | None:
        """The worker's Ready or Failed; None on timeout or EOF."""
        deadline = time.monotonic() + self.startup_timeout_s
        while (left := deadline - time.monotonic()) > 0:
            msg = await self._receive(conn, left)
            if msg is None:
                return None
            if isinstance(msg, pipe.Ready | pipe.Failed):
                return msg
        return None

    # ------------------------------------------------------------ liveness
    def _on_exit(self, h: WorkerHandle, proc: BaseProcess) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(proc.sentinel)
        proc.join(0)
        if h.process is not proc:
            return
        h.exited.set()
        h.last_exit = proc.exitcode
        if h.conn is not None:
            h.conn.close()
            h.conn = None
        if self.stopping or h.state in (STOPPING, STOPPED):
            h.state = STOPPED
            log.info("worker stopped device=%s pid=%s exit=%s", h.device, proc.pid, proc.exitcode)
            return
        h.state = LOST
        log.warning("worker lost device=%s pid=%s exit=%s", h.device, proc.pid, proc.exitcode)
        self._spawn_task(self._restart(h))

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restart(self, h: WorkerHandle) -> None:
        now = time.monotonic()
        while h.restart_times and now - h.restart_times[0] > self.restart_window_s:
            h.restart_times.popleft()
        if len(h.restart_times) >= self.max_restarts:
            h.state = FAILED
            h.last_error = (
                f"{h.last_error or 'exited'}; {len(h.restart_times)} restarts within "
                f"{self.restart_window_s:g} s (max_restarts): not restarting"
            )
            log.error("worker failed device=%s: %s", h.device, h.last_error)
            if all(w.state == FAILED for w in self.workers.values()):
                self.all_failed.set()
            return
        lo, hi = self.backoff_s
        delay = min(hi, lo * (2 ** len(h.restart_times)))
        h.restart_times.append(now)
        await asyncio.sleep(delay)
        if self.stopping:
            return
        h.restarts += 1
        h.generation += 1
        log.info("worker restarted device=%s restarts=%s after %.2f s", h.device, h.restarts, delay)
        await self._start(h)

    # ------------------------------------------------------------ stop
    def _kill(self, proc: BaseProcess) -> None:
        if proc.is_alive() and proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)

    def send(self, device: int, command: pipe.PipeMessage) -> None:
        h = self.workers[device]
        if h.conn is not None:
            with contextlib.suppress(OSError):
                pipe.send(h.conn, command)

    async def stop_all(self, timeout_s: float = 30.0) -> None:
        """Stop every worker: finish in-flight and exit; then SIGTERM; then SIGKILL."""
        self.stopping = True
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*(self._stop(h, timeout_s) for h in self.workers.values()))

    async def _stop(self, h: WorkerHandle, timeout_s: float) -> None:
        proc = h.process
        if proc is None or not proc.is_alive():
            h.state = STOPPED
            return
        capturing = h.state == STARTING  # no in-flight work yet: do not wait for it
        h.state = STOPPING
        steps: list[tuple[str, float, Callable[[], None]]] = [
            ("message", timeout_s, lambda: self.send(h.device, pipe.Drain(stop=True))),
            ("SIGTERM", 5.0, lambda: proc.terminate()),
            ("SIGKILL", 5.0, lambda: self._kill(proc)),
        ]
        if capturing:
            steps = steps[1:]
        for name, wait_s, action in steps:
            action()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(h.exited.wait(), wait_s)
            if h.exited.is_set():
                h.stopped_by = name
                break
        proc.join(1)
        h.state = STOPPED
        h.last_exit = proc.exitcode
        log.info(
            "worker stop device=%s pid=%s by=%s exit=%s",
            h.device,
            proc.pid,
            h.stopped_by,
            proc.exitcode,
        )

    def drain(self) -> None:
        for device in self.workers:
            self.send(device, pipe.Drain())
