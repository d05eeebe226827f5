"""Process-wide state of the simulated NPU: configuration, one lock, the fault,
host-thread clocks and the deadlock analysis.

Happens-before is tracked with vector clocks. Every *actor* (a stream's
executor thread, or a host thread that issues work) has a clock, a
``dict[actor_id, int]``. Edges:

- host issue -> the issued work (the work joins the host clock it was issued with);
- program order on a stream;
- Event record -> the stream or host that waited for that record;
- ExternalEvent record -> the wait that consumed it;
- stream work -> the host thread that synchronized on it;
- thread start: a new host thread begins with its starter's history; thread join:
  the joiner takes the joined thread's history;
- a host's observation of a completion -> every later host action, on any thread.

The last edge is the real-time one the hardware gives: once a host thread saw a
completion (an Event or stream synchronize, a query that returned True, a device
synchronize, a blocking host read), the observed work has finished, so work that
any thread issues afterwards runs after it. Each observation joins exactly the
clock of what was observed (the record or the stream entry waited for, never
"whatever happens to be done by now") into a process-wide *observed* clock, and
every issue joins the observed clock. So when the program's own synchronization
orders an issue after an observation (a queue, a socket round trip, asyncio), the
issue is ordered after the observed work on every run; and work nobody observed
before the issue (a patch while the replay it races with still runs) stays
unordered with it on every run.

Hazards are decided by comparing clocks, never by timing, so a missing
fence is reported on every run, whatever the interleaving was.

Performance mode checks no ordering, so it keeps no clocks: an issue, a record, a wait
and a host's observation move none (each would cost an entry per actor the process has
seen, a long-lived process's history). Leaving it, the host observes what the device
finished meanwhile (:meth:`Runtime.observe_finished_locked`), as a device synchronize at
the switch would: a checking mode then reports no race on work performance mode ordered.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import DeadlockError, SimError


class WaitInfo(Protocol):
    """What a blocked stream waits for (for the deadlock analysis and messages)."""

    def providers(self) -> Sequence[Queue]:
        """The streams whose queued work will release the wait."""

    def ready(self) -> bool: ...

    def describe(self) -> str: ...


class Queue(Protocol):
    """A device stream as the runtime sees it (a :class:`.streams.Stream`, built on the
    runtime): its name, what it is blocked on, and how a reset and shutdown stop it."""

    blocked: WaitInfo | None

    @property
    def name(self) -> str: ...

    @property
    def device_index(self) -> int: ...

    def synchronize(self) -> None: ...

    def finished_clock_locked(self) -> Clock | None:
        """The clock of the stream's last entry when it finished, else None."""

    def drop_pending_locked(self) -> None: ...

    def wait_idle_after_reset(self) -> None: ...

    def join(self, timeout: float) -> None: ...

Clock = dict[int, int]

#: ExternalEvent semantics: current CANN's binary flag (a wait clears it), older CANN's
#: (only ``reset`` clears it), or ENPU's (record before wait).
EVENT_MODES = ("cann", "legacy", "enpu")

_actor_ids = itertools.count(1)
_event_ids = itertools.count(1)


def new_actor_id() -> int:
    return next(_actor_ids)


def new_event_id() -> int:
    """The number in an event's name (Event and ExternalEvent count together)."""
    return next(_event_ids)


def clock_leq(a: Clock, b: Clock) -> bool:
    """True when everything ``a`` has seen, ``b`` has seen too (a happens-before b)."""
    return all(b.get(k, 0) >= v for k, v in a.items())


def clock_join(into: Clock, other: Clock) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


MODES = ("compute", "timed", "perf")


@dataclass(frozen=True)
class SimConfig:
    """How the simulated device behaves.

    mode: "compute" runs every op with torch on the CPU; "timed" replaces the
        compute of replayed graph tasks with ``task_us`` of device time each and
        charges ``patch_us`` of host time for every task-group patch dispatch;
        "perf" is timed with the device's work costing the host nothing (a stream's
        replay is one sleep off the interpreter lock, no Python per task, no
        correctness checks of replayed tasks) and a patch's host time split as the
        field pays it: its first ``patch_gil_us`` hold the interpreter lock (the
        Python that prepares the call), the rest does not (the op's dispatch and
        tiling in C++, which torch_npu's binding runs with the lock released).
        sim/README.md, "Performance mode".
    watchdog_s: how long a device wait that nothing queued can satisfy may
        block before it is reported as a DeadlockError.
    event_mode: "cann" (current CANN: an ExternalEvent wait may be issued before
        its record, and clears the flag), "legacy" (older CANN: a wait leaves the
        flag set until ``reset``) or "enpu" (ENPU: a wait issued before a record
        that releases it hangs on the device, so the sim reports it as a
        HazardError).
    device_memory: bytes of each simulated device (``mem_get_info``'s total; an
        allocation that does not fit raises ``torch.OutOfMemoryError``).
    collective_us: timed mode: the fixed device time of one collective of the "hccl"
        backend (:mod:`.collectives`: its latency), from when the last rank of the
        group started it.
    collective_gb_s: timed mode: the link bandwidth in GB/s a collective's bytes cross
        at, on top of ``collective_us`` (0: no bandwidth term, the cost is
        ``collective_us`` whatever the size); :func:`.collectives.collective_cost_us`.
    """

    mode: str = "compute"
    task_us: float = 0.0
    patch_us: float = 0.0
    patch_gil_us: float = 25.0
    watchdog_s: float = 30.0
    event_mode: str = "cann"
    device_memory: int = 64 << 30
    collective_us: float = 0.0
    collective_gb_s: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(
                f"sim mode must be 'compute', 'timed' or 'perf', not {self.mode!r}"
            )
        for name in ("task_us", "patch_us", "patch_gil_us", "collective_us",
                     "collective_gb_s"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"sim {name} must be >= 0")
        if self.watchdog_s <= 0:
            raise ValueError("sim watchdog_s must be > 0 (NPUSIM_WATCHDOG_S)")
        if self.event_mode not in EVENT_MODES:
            raise ValueError(
                f"sim event_mode must be 'cann', 'legacy' or 'enpu', not {self.event_mode!r} "
                "(NPUSIM_EVENT_MODE)"
            )
        if self.device_memory <= 0:
            raise ValueError("sim device_memory must be > 0 bytes (NPUSIM_DEVICE_MEMORY)")

    @property
    def timed(self) -> bool:
        """Device work is modelled time (modes "timed" and "perf")."""
        return self.mode != "compute"

    @property
    def perf(self) -> bool:
        return self.mode == "perf"

    @classmethod
    def from_env(cls) -> SimConfig:
        raw = os.environ.get("NPUSIM_WATCHDOG_S", "30")
        try:
            watchdog = float(raw)
        except ValueError:
            raise ValueError(
                f"NPUSIM_WATCHDOG_S must be a number of seconds, not {raw!r}"
            ) from None
        raw = os.environ.get("NPUSIM_DEVICE_MEMORY", str(64 << 30))
        try:
            memory = int(raw)
        except ValueError:
            raise ValueError(
                f"NPUSIM_DEVICE_MEMORY must be a number of bytes, not {raw!r}"
            ) from None
        return cls(
            watchdog_s=watchdog,
            event_mode=os.environ.get("NPUSIM_EVENT_MODE", "cann"),
            device_memory=memory,
        )


class Runtime:
    """The one simulated device runtime of this process (all device indices)."""

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.config = SimConfig.from_env()
        self.fault: SimError | None = None
        self.streams: list[Queue] = []
        # Streams whose last entry no host observed yet, or that began a capture since (a
        # device synchronize visits these alone: the others' observations are in
        # ``observed``), and streams that
        # blocked since the deadlock analysis last looked (it drops those no longer
        # blocked): neither grows with the streams the process made before.
        self.unobserved: set[Queue] = set()
        self.blocked: set[Queue] = set()
        self.device_count = 8
        self._host = threading.local()
        # What host threads observed complete (see the module doc), and a counter
        # that changes with it, so an issue joins it only after a new observation.
        self.observed: Clock = {}
        self.observed_version = 0
        # Timed mode: the latest modelled end of device work a host observed, and the
        # wall time it was observed at (see :func:`host_clock`).
        self.observed_at: tuple[float, float] = (0.0, 0.0)
        self.epoch = 0  # bumped by reset(): work of an older epoch is dropped
        self.closing = False  # set at interpreter exit: stream threads stop
        # Threads blocked in wait_for_locked, each with the condition it waits for.
        self._waiters: list[tuple[threading.Condition, Callable[[], bool]]] = []
        self._wait_cond = threading.local()

    # ------------------------------------------------------------ host clocks
    def host_actor(self) -> tuple[int, Clock]:
        h = self._host
        if not hasattr(h, "actor"):
            t = threading.current_thread()
            actor = new_actor_id()
            clock: Clock = dict(getattr(t, _START_ATTR, None) or {})  # the starter's history
            clock[actor] = 1
            h.actor, h.clock, h.seen = actor, clock, -1
            setattr(t, _CLOCK_ATTR, clock)  # what a join of this thread takes
        return h.actor, h.clock

    def _host_caught_up(self) -> tuple[Any, Any, Clock]:
        """The calling host thread's record, actor and clock, the clock having joined
        what any host observed since it last looked."""
        h = self._host
        try:
            actor, clock = h.actor, h.clock
        except AttributeError:
            actor, clock = self.host_actor()
        if h.seen != self.observed_version:
            clock_join(clock, self.observed)
            h.seen = self.observed_version
        return h, actor, clock

    def host_issue_clock(self) -> Clock:
        """Clock carried by work the calling host thread issues now; ticks the host.

        Caller holds ``cond``: the issue joins what any host observed before it."""
        _, actor, clock = self._host_caught_up()
        snap = dict(clock)
        clock[actor] += 1
        return snap

    def host_join(self, other: Clock, at: float | None = None) -> None:
        """The calling host thread observed a completion whose clock is ``other`` (in
        timed mode ``at``: the observed work's modelled end).

        Caller holds ``cond``. Later host actions of every thread are ordered after it,
        and in timed mode happen no earlier than ``at`` (:func:`host_clock`)."""
        if at is not None and at > self.observed_at[0] and self.config.timed:
            self.observed_at = (at, time.perf_counter())
        if self.config.perf:  # no clocks (module doc)
            return
        _, clock = self.host_actor()
        clock_join(clock, other)
        observed = self.observed
        for k, v in other.items():
            if observed.get(k, 0) < v:
                observed[k] = v
                self.observed_version += 1

    def host_catch_up_locked(self) -> None:
        """The calling host thread takes in what any host observed (a device synchronize:
        the streams another thread observed already). Caller holds ``cond``."""
        if not self.config.perf:
            self._host_caught_up()

    def observe_finished_locked(self) -> None:
        """The host observes the last finished entry of every stream (leaving performance
        mode, which kept no clocks: module doc). Caller holds ``cond``."""
        for s in self.streams:
            done = s.finished_clock_locked()
            if done is not None:
                self.host_join(done)

    def host_merge(self, other: Clock) -> None:
        """Program order between host threads (a thread join): no device observation."""
        _, clock = self.host_actor()
        clock_join(clock, other)

    # ------------------------------------------------------------ faults
    def raise_if_faulted(self) -> None:
        if self.fault is not None:
            raise copy.copy(self.fault) from self.fault

    def report(self, error: SimError) -> None:
        """Fault the device with ``error`` (first one wins). Caller holds ``cond``."""
        if self.fault is None:
            self.fault = error
        self.wake_all_locked()

    # ------------------------------------------------------------ waiting
    # A thread that waits for device state (a host synchronize, a stream blocked on an
    # event) registers what it waits for; a change of device state wakes only the
    # threads whose condition now holds (wake_locked), a fault or a reset wakes all.
    # Waking every waiter on every completed entry cost a thread switch each, most
    # of them to find nothing changed for them. Waits still time out, so a missed
    # wake-up only delays (the watchdog and fault checks run on time-outs too).
    def wait_for_locked(self, ready: Callable[[], bool], timeout: float) -> None:
        """Sleep until ``ready()`` may hold, a fault or a reset, or ``timeout``.

        Caller holds ``cond`` and re-checks what it waits for afterwards."""
        c = getattr(self._wait_cond, "cond", None)
        if c is None:
            c = self._wait_cond.cond = threading.Condition(self.cond._lock)  # type: ignore[attr-defined]
        entry = (c, ready)
        self._waiters.append(entry)
        try:
            c.wait(timeout)
        finally:
            self._waiters.remove(entry)

    def wake_locked(self) -> None:
        """Device state changed: wake the waiters whose condition holds. Caller holds ``cond``."""
        for c, ready in self._waiters:
            if ready():
                c.notify()

    def wake_all_locked(self) -> None:
        for c, _ in self._waiters:
            c.notify()
        self.cond.notify_all()

    def wait_until(self, predicate: Callable[[], bool], what: str) -> None:
        """Block the host until ``predicate()`` holds; raise the fault instead of hanging.

        Caller holds ``cond``. A host wait on a stream that is stuck on a device
        wait is covered by the stream's own watchdog, so this only polls.
        """
        while not predicate():
            if self.fault is not None:
                self.raise_if_faulted()
            self.wait_for_locked(predicate, 0.5)
        self.raise_if_faulted()

    # ------------------------------------------------------------ deadlocks
    def check_deadlock(self) -> None:
        """Report a cycle of blocked streams at once. Caller holds ``cond``.

        A blocked stream can still progress when one of the streams that has a
        pending record for the event it waits on can progress. Streams that are
        blocked, have such providers, and none of which can progress, wait on
        each other: that is a deadlock no host action can break (their pending
        records are queued behind their own blocked waits). Called when a
        stream blocks and when a record is issued (which adds a provider).
        """
        blocked = {s: s.blocked for s in self.blocked if s.blocked is not None}
        self.blocked = set(blocked)
        if not blocked:
            return
        # Live: running or idle (not blocked); blocked but already satisfied (about to
        # wake up); or blocked with nothing queued to release it, which a host thread may
        # still do (the watchdog covers those).
        live: set[Queue] = {s for s, w in blocked.items() if w.ready() or not w.providers()}
        changed = True
        while changed:
            changed = False
            for s, wait in blocked.items():
                if s not in live and any(p in live or p not in blocked for p in wait.providers()):
                    live.add(s)
                    changed = True
        stuck = [s for s, w in blocked.items() if s not in live and w.providers()]
        if stuck:
            lines = [f"{s.name} waits for {blocked[s].describe()}" for s in stuck]
            self.report(
                DeadlockError(
                    "deadlock: streams wait on each other, nothing can release them:\n  "
                    + "\n  ".join(lines)
                )
            )

    def provider_added_locked(self, provider: Queue) -> None:
        """Work that releases waits (records) was queued on ``provider``. Caller holds
        ``cond``. That can close a cycle only if ``provider`` is blocked now: a stream
        that is not blocked is live, and so is every wait it provides for; if it blocks
        later, :meth:`check_deadlock` runs then."""
        if provider.blocked is not None:
            self.check_deadlock()

    def watchdog_expired(self, since: float) -> bool:
        return time.monotonic() - since > self.config.watchdog_s

    # ------------------------------------------------------------ reset
    def reset(self) -> None:
        """Clear a fault and drop all pending device work (a device reset)."""
        with self.cond:
            self.fault = None
            self.epoch += 1
            for s in self.streams:
                s.drop_pending_locked()
            self.wake_all_locked()
        for s in list(self.streams):
            s.wait_idle_after_reset()
        with self.cond:
            for s in self.streams:
                s.blocked = None

    def shutdown(self, timeout: float = 5.0) -> None:
        """At interpreter exit: drop pending work and stop the stream threads, so that
        no torch op is still running while the interpreter tears down."""
        with self.cond:
            self.closing = True
        self.reset()
        for s in list(self.streams):
            s.join(timeout)


RUNTIME = Runtime()

_START_ATTR = "_graphlane_sim_start_clock"
_CLOCK_ATTR = "_graphlane_sim_clock"


def _thread_history() -> Clock | None:
    """The calling thread's host clock, or the history it was started with."""
    clock = getattr(RUNTIME._host, "clock", None)
    if clock is not None:
        return clock
    history: Clock | None = getattr(threading.current_thread(), _START_ATTR, None)
    return history


_thread_start = threading.Thread.start
_thread_join = threading.Thread.join


def _start(self: threading.Thread) -> None:
    history = _thread_history()
    if history is not None:
        setattr(self, _START_ATTR, dict(history))
        h = RUNTIME._host
        own: Clock | None = getattr(h, "clock", None)
        if own is not None:  # the starter's later actions are not ordered before the child's
            own[h.actor] += 1
    _thread_start(self)


def _join(self: threading.Thread, timeout: float | None = None) -> None:
    _thread_join(self, timeout)
    if not self.is_alive():
        history = getattr(self, _CLOCK_ATTR, None) or getattr(self, _START_ATTR, None)
        if history:
            RUNTIME.host_merge(history)


def install_thread_edges() -> None:
    """Order host threads as the OS does: ``Thread.start`` and ``Thread.join`` carry the
    starter's and the joined thread's histories (idempotent)."""
    if threading.Thread.start is not _start:
        threading.Thread.start = _start  # type: ignore[method-assign]
        threading.Thread.join = _join  # type: ignore[method-assign]


def configure(
    *,
    mode: str | None = None,
    task_us: float | None = None,
    patch_us: float | None = None,
    patch_gil_us: float | None = None,
    watchdog_s: float | None = None,
    event_mode: str | None = None,
    device_memory: int | None = None,
    collective_us: float | None = None,
    collective_gb_s: float | None = None,
) -> SimConfig:
    """Change the device's cost model (``collective_us`` and ``collective_gb_s``: a
    collective's latency and link bandwidth in timed mode), watchdog or ExternalEvent
    mode; returns the config now in force."""
    old = RUNTIME.config
    new = SimConfig(
        mode=old.mode if mode is None else mode,
        task_us=old.task_us if task_us is None else task_us,
        patch_us=old.patch_us if patch_us is None else patch_us,
        patch_gil_us=old.patch_gil_us if patch_gil_us is None else patch_gil_us,
        watchdog_s=old.watchdog_s if watchdog_s is None else watchdog_s,
        event_mode=old.event_mode if event_mode is None else event_mode,
        device_memory=old.device_memory if device_memory is None else device_memory,
        collective_us=old.collective_us if collective_us is None else collective_us,
        collective_gb_s=old.collective_gb_s if collective_gb_s is None else collective_gb_s,
    )
    if old.perf and not new.perf:
        with RUNTIME.cond:
            RUNTIME.config = new
            RUNTIME.observe_finished_locked()  # performance mode kept no clocks
    RUNTIME.config = new
    if old.perf != new.perf:
        _switch_interval_for(new.perf)
    return new


#: The interpreter's switch interval while the simulator's stream threads run Python
#: per task (compute and timed modes): a thread waiting for the interpreter lock asks
#: the holder for it after this long (Python's default is 5 ms). The stream threads
#: stand in for independent hardware queues, and a busy host thread would otherwise hold
#: a stream that is ready to run back for up to 5 ms.
SIM_SWITCH_INTERVAL_S = 0.0002

#: The switch interval the program had when the simulator shortened it (None until then).
_program_switch_interval_s: float | None = None


def shorten_switch_interval() -> None:
    """Set :data:`SIM_SWITCH_INTERVAL_S` process-wide, remembering the program's own
    interval, unless performance mode is on (see :func:`_switch_interval_for`)."""
    global _program_switch_interval_s
    if _program_switch_interval_s is None:
        _program_switch_interval_s = sys.getswitchinterval()
    if not RUNTIME.config.perf:
        sys.setswitchinterval(SIM_SWITCH_INTERVAL_S)


def _switch_interval_for(perf: bool) -> None:
    """Performance mode runs the program at its own switch interval, compute and timed
    modes at the simulator's. In performance mode the stream threads run no Python per
    task (a replay is one sleep), so they need no quick hand-over; and the program's own
    threads must share the interpreter lock as they do on the NPU host, where nothing of
    the device's takes it: a program that updates its graph on one thread while its
    scheduler's Python runs on another waits up to the program's interval (5 ms unless
    it set its own) for the lock, not 0.2 ms. A program that set an interval of its own
    since keeps it: only the other side's value is replaced."""
    program = _program_switch_interval_s
    if program is None:
        return  # the backend is not set up: the interval was never shortened
    now = sys.getswitchinterval()
    if perf and math.isclose(now, SIM_SWITCH_INTERVAL_S, rel_tol=1e-3):
        sys.setswitchinterval(program)
    elif not perf and math.isclose(now, program, rel_tol=1e-3):
        sys.setswitchinterval(SIM_SWITCH_INTERVAL_S)


def busy_until(deadline: float) -> float:
    """Occupy the calling thread until ``deadline`` (monotonic seconds), GIL released;
    returns when it got control back (``deadline`` plus the sleep's oversleep)."""
    while True:
        now = time.perf_counter()
        if now >= deadline:
            return now
        time.sleep(deadline - now)


class CostClock:
    """Charges modelled costs so that back-to-back work takes the modelled time.

    A charge for work that began at ``started`` ends at ``start + cost``, where
    ``start`` is the end of the previous charge when the work followed it
    closely (within ``SLACK_S``), else ``started``. The simulator's own Python
    overhead and a sleep's oversleep are thereby counted inside the modelled
    cost instead of being added to it, as long as they are smaller than it.

    The window of ``SLACK_S`` opens when the thread got control back from its
    last wait for a charge, not at the charge's modelled end: a sleep that wakes
    late (the machine was busy, or another thread held the interpreter) is the
    simulator's delay, not work of the thread's, so it does not eat the window.

    Only a gap the thread spent computing is hidden. If it did not run for part of
    the gap (blocked on a queue, a socket, a lock, or not scheduled), the work starts
    when it started: the thread may have waited for something the simulator cannot
    see (a request on a socket), which happened in wall time, and work must not start
    in the model before its cause. The window hides the simulator's Python, never a
    wait: a worker that idles between a reply and the next request starts that
    request's patch when it issues it, neither back to back with the last one nor
    from the device's modelled end the host noticed late (either let a step through a
    daemon be held for less than its floor: tests/daemon/test_daemon_floors.py).

    :meth:`add` charges without waiting and :meth:`settle` waits for what was
    added: a stream running several tasks in a row with nothing in between that
    another stream or the host could observe (no record, no wait) sleeps once for
    all of them, so its sleeps' oversleep and wake-ups are paid once, as a
    device that runs them back to back pays nothing between them.
    """

    SLACK_S = 0.0005
    IDLE_NOISE_S = 20e-6

    def __init__(self) -> None:
        self.end = 0.0
        self.woke = 0.0  # when the last wait for a charge returned
        self.woke_cpu = 0.0  # the thread's CPU time (time.thread_time) then

    def start_for(self, t0: float, cpu: float | None = None) -> float:
        """Where work that began at wall time ``t0`` (the thread's CPU time then:
        ``cpu``, default now) starts in the model: back to back with the previous
        charge plus the part of the gap the thread did not compute, within the window;
        ``t0`` after it."""
        ref = max(self.end, self.woke)
        if t0 >= ref + self.SLACK_S:
            return t0
        if t0 - ref <= self.IDLE_NOISE_S:
            return self.end  # a gap that short is not a wait, whatever the thread did
        computed = (time.thread_time() if cpu is None else cpu) - self.woke_cpu
        # The two clocks are read at different instants: a few microseconds of "idle"
        # are that, not a wait (and would make modelled times inexact).
        if (t0 - ref) - computed > self.IDLE_NOISE_S:
            # The thread did not run for part of the gap: it waited (on a queue, a
            # socket, a lock) for something the simulator cannot see, which happened
            # in wall time. What follows the wait starts when it started: hiding the
            # Python before the wait, or the host's lag behind the device's modelled
            # end, would start it before what it waited for (a daemon's lone step
            # held for less than its floor from the request's arrival).
            return t0
        return self.end

    def woke_at(self, wall: float, cpu: float) -> None:
        self.woke, self.woke_cpu = wall, cpu

    def add(self, cost_us: float, started: float | None = None) -> None:
        if cost_us <= 0:
            return
        t0 = time.perf_counter() if started is None else started
        self.end = self.start_for(t0) + cost_us * 1e-6

    def add_at(self, cost_us: float, at: float) -> None:
        """Charge work that starts at modelled time ``at`` (no simulator delay in it, so
        no slack applies), or when the previous charge ends if that is later."""
        if cost_us > 0:
            self.end = max(self.end, at) + cost_us * 1e-6

    def settle(self) -> None:
        if self.end > self.woke:
            self.woke_at(busy_until(self.end), time.thread_time())

    def charge(self, cost_us: float, started: float | None = None) -> None:
        if cost_us > 0:
            self.add(cost_us, started)
            self.woke_at(busy_until(self.end), time.thread_time())


class _HostCost(threading.local):
    def __init__(self) -> None:
        self.clock = CostClock()


#: Each host thread's charged time (a timed patch's host dispatch: routing.py).
HOST_COST = _HostCost()


def host_clock(started: float) -> CostClock:
    """The calling host thread's cost clock, for host work that began at ``started``
    (wall): caught up with what any host observed the device finish before then.

    A host that waited for device work (a synchronize, a blocking read, a query that
    found it done) is at the work's modelled end or later when it goes on: the slack
    hides the simulator's Python between two charges, never the device's work and the
    host's wait for it. Without this, a loop that waits for each step would count its
    next update from the end of its last one, as if the step's last task and the wait
    took no time (4 layers of 185 us updates and 60 us tasks: 0.74 ms per step against
    a floor of 0.80). The observation is process-wide, as happens-before is (the thread
    that saw the step end may hand it to the one that issues the next, by a queue or a
    socket the simulator cannot see); work that began before it is not moved."""
    c = HOST_COST.clock
    at, seen = RUNTIME.observed_at
    if at > c.end and seen <= started:
        c.end = at
        if seen > c.woke:  # the window of slack opens at the observation
            # Nothing the thread did since is hidden, its own observation or not: the
            # host's Python after it saw a step end is the program's (reply, take the
            # next request, plan it), which the modelled costs do not contain, and what
            # it did may have been to take news the sim cannot see (a request already
            # queued on a socket: no wait shows it), which must not start in the model
            # before it came. Work issued within IDLE_NOISE_S of the observation starts
            # at the modelled end: the host's lag behind the device's end is the sim's.
            c.woke_at(seen, time.thread_time())
    return c


def model_now() -> float:
    """The calling host thread's time in the timed cost model: the end of its last
    charge (or of device work it observed since) while it is within ``SLACK_S`` of it
    (its Python since then is hidden inside that charge, as CostClock hides it between
    charges), else now.

    Work the host issues carries it (see :class:`.streams.Stream`), so what
    the device does after a charged patch starts from the patch's modelled end, not
    from when the simulator's threads got round to it."""
    now = time.perf_counter()
    c = host_clock(now)
    if c.end:
        return min(now, c.start_for(now))
    return now
