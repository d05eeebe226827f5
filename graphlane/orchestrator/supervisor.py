"""Spawns, watches and restarts the worker processes (one per device).

Lifecycle of a worker, explicit:

    spawn (multiprocessing "spawn") -> handshake: pipe.Ready(info) on its pipe within
    startup_timeout_s -> READY; liveness through the process sentinel (an fd that
    becomes readable when the process ends) -> LOST -> restart after a backoff,
    unless more than max_restarts happened within restart_window_s -> FAILED.
    A worker that answers the handshake with a *permanent* pipe.Failed (a bad
    configuration or program, a missing dependency, no such device: it would fail
    the same way again) is FAILED at once, without a restart.
    stop: pipe.Finish(stop=True) (finish in-flight, exit) -> SIGTERM -> SIGKILL,
    recording which step ended it.

The workers of a tensor-parallel group (graphlane/orchestrator/groups.py) live and die
together: they start together (with a rendezvous and a forwarding channel on ports
taken afresh each time), a rank that is lost takes the others down with it and the
group restarts as one, with one restart count and one generation, so that every
sequence of the group gets STATE_LOST; a rank that fails for good fails the group.

The pipe is also the worker's lifeline: when the orchestrator dies, the worker
reads EOF and exits, so no orphan keeps a device. Only the typed messages of
:mod:`graphlane.protocol.pipe` cross it. Each process's end of its pipe has one
owner, a :class:`WorkerPipe`: one reader registered with the event loop for the
life of the process, which queues what it reads; the handshake and the health
checks take messages from that queue. The reader is removed by its fd number
*before* the pipe is closed: a closed fd's number is reused by the next pipe, and
a reader left behind for it would keep the new pipe from ever being watched.
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from graphlane.protocol import pipe
from graphlane.workers.entry import group_main, worker_main
from graphlane.workers.spec import WorkerSpec

from .ports import free_loopback_ports

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


class WorkerPipe:
    """The supervisor's end of one worker process's pipe, and its only reader.

    A reader callback, registered once for the life of the process, reads each
    message as it arrives into a queue (None marks the end: EOF or closed);
    :meth:`receive` takes from that queue. :meth:`close` drains what the worker
    sent before it died (its ``Failed``), removes the reader by the fd number it was
    registered with, and only then closes the pipe."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.fd = conn.fileno()
        self.closed = False
        self._loop = asyncio.get_running_loop()
        self._messages: asyncio.Queue[pipe.PipeMessage | None] = asyncio.Queue()
        self._loop.add_reader(self.fd, self._read)

    def _read(self) -> None:
        try:
            message = pipe.recv(self.conn)
        except (EOFError, OSError):
            self.close()
            return
        except ValueError as exc:  # not one of ours: nothing to hand over
            log.warning("ignored a message on a worker pipe: %s", exc)
            return
        self._messages.put_nowait(message)

    def send(self, message: pipe.PipeMessage) -> None:
        if not self.closed:
            with contextlib.suppress(OSError):
                pipe.send(self.conn, message)

    async def receive(self, limit_s: float) -> pipe.PipeMessage | None:
        """The next message; None at the end of the pipe or after ``limit_s``."""
        if self._messages.empty() and self.closed:
            return None
        try:
            return await asyncio.wait_for(self._messages.get(), limit_s)
        except TimeoutError:
            return None

    def close(self) -> None:
        """Idempotent. Messages already in the pipe are queued first."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(EOFError, OSError, ValueError):
            while self.conn.poll(0):
                self._messages.put_nowait(pipe.recv(self.conn))
        self._loop.remove_reader(self.fd)  # by number, while the fd is still ours
        self.conn.close()
        self._messages.put_nowait(None)


@dataclass(eq=False)
class WorkerHandle:
    spec: WorkerSpec
    state: WorkerState = STARTING
    process: BaseProcess | None = None
    pipe: WorkerPipe | None = None  # the current process's pipe
    info: dict[str, Any] = field(default_factory=dict)
    restarts: int = 0
    restart_times: deque[float] = field(default_factory=deque)
    generation: int = 0
    last_exit: int | None = None
    last_error: str = ""
    stopped_by: str = ""
    stats: dict[str, Any] = field(default_factory=dict)  # the worker's latest status report
    exited: asyncio.Event = field(default_factory=asyncio.Event)  # the current process ended
    restarting: bool = False  # (a group's leader) its group is being taken down to restart

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
            # the npusim extensions the sim backend turned on (not the NPU's; absent: none)
            **(
                {"sim_extensions": self.info["sim_extensions"]}
                if self.info.get("sim_extensions")
                else {}
            ),
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
        groups: Mapping[int, tuple[int, ...]] | None = None,
    ) -> None:
        """``groups``: each device of a tensor-parallel group -> the group's devices in
        rank order (a device not in it serves alone)."""
        # Each worker's first generation is its spec's (the daemon's, see daemon.py).
        self.workers = {s.device: WorkerHandle(s, generation=s.generation) for s in specs}
        self.startup_timeout_s = startup_timeout_s
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.backoff_s = backoff_s
        self.hang_timeout_s = hang_timeout_s
        self.poll_s = poll_s
        self.env_for = env_for or (lambda device: {})
        self.groups = dict(groups or {})
        self.stopping = False
        self.all_failed = asyncio.Event()  # set when every worker is FAILED for good
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ctx = mp.get_context("spawn")

    # ------------------------------------------------------------ start
    async def start_all(self) -> None:
        units = {self._unit(h)[0].device: self._unit(h) for h in self.workers.values()}
        await asyncio.gather(*(self._start_unit(u) for u in units.values()))

    def _unit(self, h: WorkerHandle) -> list[WorkerHandle]:
        """The workers that start, stop and restart with ``h``: its group's, leader first."""
        devices = self.groups.get(h.device)
        return [self.workers[d] for d in devices] if devices else [h]

    async def _start_unit(self, unit: list[WorkerHandle]) -> None:
        if len(unit) == 1:
            await self._start(unit[0])
            return
        rendezvous, channel = free_loopback_ports(2)
        for h in unit:
            assert h.spec.group is not None
            group = replace(
                h.spec.group,
                init_method=f"tcp://127.0.0.1:{rendezvous}",
                channel=f"tcp://127.0.0.1:{channel}",
                timeout_s=self.startup_timeout_s,
            )
            h.spec = replace(h.spec, group=group)
        started = await asyncio.gather(*(self._start(h) for h in unit), return_exceptions=True)
        errors = [e for e in started if isinstance(e, BaseException)]
        if errors:  # a rank the system would not start: the others go too, then retry
            await self._end_group(unit, None, "a rank of its group could not be started")
            raise errors[0]

    async def _end_group(
        self, unit: list[WorkerHandle], cause: WorkerHandle | None, why: str
    ) -> None:
        """Take down every rank of ``unit`` but ``cause`` (lost already), and wait for
        their ends: a group serves whole or not at all."""
        ending = []
        for m in unit:
            if m is cause or m.process is None or m.exited.is_set():
                continue
            m.state = LOST
            m.last_error = f"group restart: {f'device {cause.device} ' if cause else ''}{why}"
            self._kill(m.process)
            ending.append(m.exited.wait())
        if ending:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*ending), 10.0)

    async def _start(self, h: WorkerHandle) -> None:
        h.state = STARTING
        spec = replace(h.spec, generation=h.generation)
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=worker_main if spec.group is None else group_main,
            args=(spec, child),
            name=f"graphlane-worker-{h.device}",
            daemon=True,
        )
        env = self.env_for(h.device)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # a spawned child takes the parent's environment at start
        try:
            proc.start()
        except BaseException:  # (out of file descriptors, of processes: OSError)
            parent.close()
            child.close()
            raise
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()
        conn = WorkerPipe(parent)
        h.process, h.pipe = proc, conn
        h.exited = asyncio.Event()
        log.info("worker start device=%s pid=%s generation=%s", h.device, proc.pid, h.generation)
        loop = asyncio.get_running_loop()
        loop.add_reader(proc.sentinel, self._on_exit, h, proc, proc.sentinel)
        msg = await self._handshake(conn)
        if h.process is not proc or h.state != STARTING:
            return  # stopped during startup
        if isinstance(msg, pipe.Ready) and not h.exited.is_set():
            h.info = dict(msg.info)
            h.state = READY
            h.last_error = ""
            log.info(
                "worker ready device=%s pid=%s endpoint=%s",
                h.device,
                proc.pid,
                h.info.get("endpoint"),
            )
            self._spawn_task(self._watch(h, proc, conn))
            return
        if isinstance(msg, pipe.Failed) and msg.permanent:
            # It would fail the same way again: no restart (the worker exits by itself).
            log.error(
                "worker failed to start device=%s pid=%s: %s (permanent: not restarting)",
                h.device,
                proc.pid,
                msg.message,
            )
            self._failed(h, msg.message)
            return
        if isinstance(msg, pipe.Failed):
            h.last_error = msg.message
        elif conn.closed:  # (a Ready read only after the exit too)
            h.last_error = "exited during startup" + (
                f" (exit {proc.exitcode})" if proc.exitcode is not None else ""
            )
        else:
            h.last_error = f"no handshake within {self.startup_timeout_s:g} s"
        log.error("worker failed to start device=%s pid=%s: %s", h.device, proc.pid, h.last_error)
        h.state = LOST  # a transient failure: restarted, with backoff, once it has exited
        if h.exited.is_set():
            self._spawn_task(self._restart(h, proc))
        else:
            self._kill(proc)  # _on_exit restarts it

    async def _watch(self, h: WorkerHandle, proc: BaseProcess, conn: WorkerPipe) -> None:
        """Health and figures, about once per poll_s. A worker that does not answer, or
        holds requests and answers none of them for hang_timeout_s (a device wait that
        never ends), is killed; the normal restart path replaces it."""
        while True:
            await asyncio.sleep(self.poll_s)
            if h.process is not proc or h.state != READY or h.pipe is not conn:
                return
            conn.send(pipe.Ping())
            msg = await conn.receive(self.hang_timeout_s)
            if h.process is not proc or h.state != READY or conn.closed:
                return  # it ended: _on_exit took over
            if not isinstance(msg, pipe.Pong):
                self._hung(h, proc, f"no answer to a health check within {self.hang_timeout_s:g} s")
                return
            h.stats = msg.status
            # Stalled, not old: a burst queued behind a slow device (a loaded host, a long
            # replay) has requests older than hang_timeout_s while steps keep completing;
            # a device wait that never ends completes nothing.
            stalled = float(h.stats.get("stalled_s", 0.0))
            if stalled > self.hang_timeout_s:
                inflight = h.stats.get("inflight", 0)
                self._hung(
                    h,
                    proc,
                    f"{inflight} request(s) open and none answered for {stalled:.1f} s "
                    "(hang_timeout_s)",
                )
                return

    def _hung(self, h: WorkerHandle, proc: BaseProcess, why: str) -> None:
        h.last_error = f"hung: {why}"
        log.error("worker hung device=%s pid=%s: %s; killing it", h.device, proc.pid, why)
        self._kill(proc)

    async def _handshake(self, conn: WorkerPipe) -> pipe.Ready | pipe.Failed | None:
        """The worker's Ready or Failed; None on timeout or at the end of the pipe."""
        deadline = time.monotonic() + self.startup_timeout_s
        while (left := deadline - time.monotonic()) > 0:
            msg = await conn.receive(left)
            if msg is None:
                return None
            if isinstance(msg, pipe.Ready | pipe.Failed):
                return msg
        return None

    # ------------------------------------------------------------ liveness
    def _on_exit(self, h: WorkerHandle, proc: BaseProcess, sentinel: int) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(sentinel)
        # The sentinel closes as the process exits, a moment before its exit status
        # can be collected: wait that moment, so that the exit code is known.
        proc.join(0.2)
        if h.process is not proc:
            return
        h.exited.set()
        h.last_exit = proc.exitcode
        if h.pipe is not None:
            h.pipe.close()  # what it said last stays readable: the handshake may want it
        if h.state == FAILED:
            return  # it failed for good, and said why
        if self.stopping or h.state in (STOPPING, STOPPED):
            h.state = STOPPED  # _stop says how it ended
            return
        if h.state == STARTING:
            return  # the handshake reads its last words and decides
        if h.state == READY:
            h.state = LOST
            log.warning("worker lost device=%s pid=%s exit=%s", h.device, proc.pid, proc.exitcode)
        self._spawn_task(self._restart(h, proc))

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("supervisor task failed: %s: %s", type(exc).__name__, exc, exc_info=exc)

    def _failed(self, h: WorkerHandle, why: str) -> None:
        """Mark ``h`` FAILED for good (no more restarts), and the rest of its group."""
        for m in self._unit(h):
            if m is not h:
                m.state = FAILED
                m.last_error = f"device {h.device} of its group failed: {why}"
                if m.process is not None and not m.exited.is_set():
                    self._kill(m.process)
        h.state = FAILED
        h.last_error = why
        if all(w.state == FAILED for w in self.workers.values()):
            self.all_failed.set()

    async def _restart(self, h: WorkerHandle, proc: BaseProcess) -> None:
        """Restart ``h`` (its whole group, counted on the group's leader) after ``proc``
        ended; nothing if a newer process replaced it, or its group restarts already."""
        unit = self._unit(h)
        lead = unit[0]
        if h.process is not proc or lead.restarting or h.state == FAILED:
            return
        lead.restarting = True
        try:
            if len(unit) > 1:
                await self._end_group(unit, h, f"(rank {unit.index(h)}) {h.last_error or 'exited'}")
            now = time.monotonic()
            times = lead.restart_times
            while times and now - times[0] > self.restart_window_s:
                times.popleft()
            if len(times) >= self.max_restarts:
                why = (
                    f"{h.last_error or 'exited'}; {len(times)} restarts within "
                    f"{self.restart_window_s:g} s (max_restarts): not restarting"
                )
                log.error("worker failed device=%s: %s", h.device, why)
                self._failed(h, why)
                return
            lo, hi = self.backoff_s
            delay = min(hi, lo * (2 ** len(times)))
            times.append(now)
            await asyncio.sleep(delay)
        finally:
            lead.restarting = False
        if self.stopping:
            return
        for m in unit:
            m.restarts += 1
            m.generation += 1
        log.info(
            "worker restarted device=%s restarts=%s after %.2f s%s", h.device, h.restarts, delay,
            f" (with its group: devices {[m.device for m in unit]})" if len(unit) > 1 else "",
        )  # fmt: skip
        # A start that the system refuses (no file descriptor, process or memory left:
        # an OSError) is not the worker failing: retried with backoff, uncounted, for as
        # long as it takes, so the worker comes back once the system has room again.
        while True:
            try:
                await self._start_unit(unit)
                return
            except OSError as exc:
                delay = min(hi, max(lo, delay * 2))
                for m in unit:
                    m.state = LOST
                h.last_error = f"cannot start a worker process: {exc}; retrying in {delay:.1f} s"
                log.error("worker start failed device=%s: %s", h.device, h.last_error)
                await asyncio.sleep(delay)
                if self.stopping:
                    return

    def behind(self, h: WorkerHandle) -> int:
        """Steps ``h``'s group leader completed that ``h`` has not (0 for a leader or a
        worker alone), from their latest reports (about poll_s apart: a few steps are
        in flight; a growing number is a rank that falls behind)."""
        if h.spec.group is None:
            return 0
        leader = self.workers[h.spec.group.devices[0]]
        return max(0, int(leader.stats.get("steps", 0)) - int(h.stats.get("steps", 0)))

    # ------------------------------------------------------------ stop
    def _kill(self, proc: BaseProcess) -> None:
        if proc.is_alive() and proc.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)

    def send(self, device: int, command: pipe.PipeMessage) -> None:
        h = self.workers[device]
        if h.pipe is not None:
            h.pipe.send(command)

    async def stop_all(self, timeout_s: float = 30.0) -> None:
        """Stop every worker: finish in-flight and exit; then SIGTERM; then SIGKILL."""
        self.stopping = True
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*(self._stop(h, timeout_s) for h in self.workers.values()))

    async def _stop(self, h: WorkerHandle, timeout_s: float) -> None:
        proc = h.process
        if proc is None or h.exited.is_set() or not proc.is_alive():
            if h.state != FAILED:  # a worker that failed for good says so to the end
                h.state = STOPPED
            return
        if h.state == FAILED:  # it exits by itself after its Failed; make sure it did
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(h.exited.wait(), 5.0)
            self._kill(proc)
            proc.join(1)
            return
        capturing = h.state == STARTING  # no in-flight work yet: do not wait for it
        h.state = STOPPING
        steps: list[tuple[str, float, Callable[[], None]]] = [
            ("message", timeout_s, lambda: self.send(h.device, pipe.Finish(stop=True))),
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
            self.send(device, pipe.Finish())
