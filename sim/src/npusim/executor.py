"""The device side of a simulated stream: an in-order queue of work and its thread.

:class:`StreamExecutor` is the part of :class:`.streams.Stream` that executes.
Host threads issue :class:`Work` (:meth:`~StreamExecutor.issue`): it is queued as
an entry stamped with the issuing host's clock, and the stream's own thread,
started by the first issue, runs the entries in order, asynchronously to the host
and to the other streams. A wait inside an entry blocks that thread
(:meth:`~StreamExecutor.block_until`, which runs the deadlock analysis); an error
in one is reported as the device's fault. The host waits for the queue with
``synchronize`` and ``query``; a device reset drops what is pending.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .errors import DeadlockError, DeviceFaultError, SimError, SimUsageError
from .runtime import RUNTIME, Clock, CostClock, model_now, new_actor_id

if TYPE_CHECKING:
    from .graphs import CaptureState
    from .streams import Stream
    from .task_groups import UpdateState


class Dropped(Exception):
    """Raised inside a stream thread when its work is abandoned (fault or reset)."""


class Work(Protocol):
    """Something a stream executes, eagerly or as a node of a replayed graph."""

    label: str

    def run(self, ex: Stream) -> None: ...


class WaitInfo(Protocol):
    """What a blocked stream waits for (for the deadlock analysis and messages)."""

    def providers(self) -> list[Stream]: ...

    def ready(self) -> bool: ...

    def describe(self) -> str: ...


class _Entry:
    __slots__ = ("clock", "done", "done_at", "done_clock", "epoch", "model", "work")

    def __init__(self, work: Work, clock: Clock, epoch: int, model: float) -> None:
        self.work = work
        self.clock = clock
        self.epoch = epoch
        self.model = model  # the issuing host's time in the timed model (0: compute mode)
        self.done = False
        self.done_clock: Clock = {}
        self.done_at = 0.0  # timed mode: the stream's modelled time when it finished


class OpWork:
    """One eager device op: ``fn()`` runs on the stream thread."""

    __slots__ = ("fn", "label")

    def __init__(self, label: str, fn: Callable[[], Any]) -> None:
        self.label = label
        self.fn = fn

    def run(self, ex: Stream) -> None:
        ex.tick()
        self.fn()


class StreamExecutor:
    """The queue and executor thread of a :class:`.streams.Stream` (its first base, so
    that these methods, not ``torch.Stream``'s, are the stream's)."""

    # What work issued to the stream turns into (the Stream sets them: :mod:`.routing`).
    capturing: CaptureState | None
    updating: UpdateState | None

    def __init__(self) -> None:
        self.actor = new_actor_id()
        self.clock: Clock = {self.actor: 0}
        self.cost = CostClock()
        self.resume_at: float | None = None  # when the last device wait was satisfied
        # Timed mode: where this stream is in modelled time (see ``timed_now``).
        self.model_time = 0.0
        self._queue: deque[_Entry] = deque()
        self._last: _Entry | None = None
        self._wake = threading.Condition(RUNTIME.cond._lock)  # type: ignore[attr-defined]
        self._thread: threading.Thread | None = None
        self._idle = True
        self.blocked: WaitInfo | None = None
        self.run_epoch = 0  # the epoch of the entry this stream's thread is running

    @property
    def name(self) -> str:
        raise NotImplementedError  # the Stream's

    # ------------------------------------------------------------ issue
    def issue(self, work: Work) -> None:
        """Queue ``work`` (host side). Caller must not hold the runtime lock."""
        with RUNTIME.cond:
            self.issue_locked(work)

    def issue_locked(self, work: Work) -> None:
        model = model_now() if RUNTIME.config.mode == "timed" else 0.0
        entry = _Entry(work, RUNTIME.host_issue_clock(), RUNTIME.epoch, model)
        self._queue.append(entry)
        self._last = entry
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"sim-{self.name}", daemon=True)
            self._thread.start()
        if self._idle:  # a busy executor takes the entry without being woken
            self._wake.notify()

    def run_now(self, label: str, fn: Callable[[], Any]) -> Any:
        """Queue ``fn`` and block the host until it ran; returns its result (a host read)."""
        result: list[Any] = []
        self.issue(OpWork(label, lambda: result.append(fn())))
        self.synchronize()
        return result[0]

    # ------------------------------------------------------------ executor thread
    def tick(self) -> None:
        self.clock[self.actor] += 1

    def resume(self, at: float) -> None:
        """A wait in the running entry was satisfied at (modelled) time ``at``: the work
        after it starts there (``resume_at``), and the stream's modelled time is past it."""
        self.resume_at = at
        if at > self.model_time:
            self.model_time = at

    def settle(self) -> None:
        """Wait until the device time charged so far is over; the stream's modelled time
        is then past it."""
        cost = self.cost
        cost.settle()
        if cost.end > self.model_time:
            self.model_time = cost.end

    def timed_now(self) -> float:
        """When this stream's current work happens: in timed mode its modelled time (its
        entry's issue in the host's model, the waits it passed, the device time it was
        charged), which leaves out the simulator's own delays in getting to it; in
        compute mode the wall clock."""
        if RUNTIME.config.mode == "timed":
            return self.model_time
        return time.perf_counter()

    def _loop(self) -> None:
        cond = RUNTIME.cond
        entry: _Entry | None = None
        while True:
            with cond:  # one critical section per entry: finish one, take the next
                if entry is not None:
                    self._finish_locked(entry)
                while not self._queue:
                    self._idle = True
                    RUNTIME.wake_locked()
                    if RUNTIME.closing:
                        return
                    self._wake.wait()
                self._idle = False
                entry = self._queue[0]
                self.run_epoch = entry.epoch  # waits inside this entry drop after a reset
                stale = entry.epoch != RUNTIME.epoch or RUNTIME.fault is not None
            if not stale:
                for k, v in entry.clock.items():
                    if self.clock.get(k, 0) < v:
                        self.clock[k] = v
                self.resume_at = None  # a wait's release time holds within one entry
                if entry.model > self.model_time:  # it could not start before its issue
                    self.model_time = entry.model
                try:
                    entry.work.run(self)  # type: ignore[arg-type]  # self is a Stream
                except Dropped:
                    pass
                except SimError as exc:
                    with cond:
                        RUNTIME.report(exc)
                except Exception as exc:
                    with cond:
                        RUNTIME.report(
                            DeviceFaultError(
                                f"{entry.work.label} failed on {self.name}: "
                                f"{type(exc).__name__}: {exc}"
                            )
                        )

    def _finish_locked(self, entry: _Entry) -> None:
        self.blocked = None
        entry.done = True
        entry.done_clock = dict(self.clock)
        entry.done_at = self.model_time
        if self._queue and self._queue[0] is entry:
            self._queue.popleft()
        if self._queue:  # else the idle loop wakes the waiters
            RUNTIME.wake_locked()

    def block_until(self, ready: Callable[[], bool], wait: WaitInfo, epoch: int) -> None:
        """Stream-thread wait for device state; caller holds the runtime lock.

        Runs the deadlock analysis when it blocks; waits with no pending
        provider (only the host can release them) are bounded by the watchdog.
        """
        since = time.monotonic()
        while not ready():
            if RUNTIME.fault is not None or RUNTIME.epoch != epoch:
                self.blocked = None
                raise Dropped
            if self.blocked is None:
                self.blocked = wait
                RUNTIME.check_deadlock()
                continue
            if not wait.providers() and RUNTIME.watchdog_expired(since):
                RUNTIME.report(
                    DeadlockError(
                        f"deadlock: {self.name} has waited {RUNTIME.config.watchdog_s:g} s for "
                        f"{wait.describe()}, and no queued work will release it "
                        "(NPUSIM_WATCHDOG_S sets this limit)",
                        kind="watchdog",
                    )
                )
                continue
            RUNTIME.wait_for_locked(ready, 0.25)
        self.blocked = None

    # ------------------------------------------------------------ host side
    def synchronize(self) -> None:
        """Block the host until all work issued to this stream so far ran."""
        with RUNTIME.cond:
            RUNTIME.raise_if_faulted()
            if self.capturing is not None:
                raise SimUsageError(
                    f"synchronize() on {self.name} while it captures a graph is not allowed"
                )
            target = self._last
            if target is None:
                return
            RUNTIME.wait_until(lambda: target.done, f"{self.name} to finish")
            RUNTIME.host_join(target.done_clock, target.done_at)

    def query(self) -> bool:
        with RUNTIME.cond:
            RUNTIME.raise_if_faulted()
            target = self._last
            if target is None:
                return True
            if target.done:
                RUNTIME.host_join(target.done_clock, target.done_at)
            return target.done

    # ------------------------------------------------------------ reset support
    def drop_pending_locked(self) -> None:
        """Forget queued work (device reset); the running entry finishes or drops itself."""
        running = self._queue[0] if self._queue and not self._idle else None
        for entry in self._queue:
            if entry is not running:
                entry.done = True
        self._queue = deque([running] if running is not None else [])
        self.capturing = None
        self.updating = None
        self._wake.notify()

    def join(self, timeout: float) -> None:
        with RUNTIME.cond:
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def wait_idle_after_reset(self) -> None:
        with RUNTIME.cond:
            while self._queue and self._thread is not None:
                RUNTIME.wait_for_locked(lambda: not self._queue, 0.05)
