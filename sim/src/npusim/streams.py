"""Streams and events of the simulated NPU.

A stream is an in-order queue of work executed by its own thread, asynchronously to
the host and to the other streams. Host threads issue :class:`Work`
(:meth:`Stream.issue`): it is queued as an entry stamped with the issuing host's
clock, and the stream's thread, started by the first issue, runs the entries in
order. A wait inside an entry blocks that thread (:meth:`Stream.block_until`, which
runs the deadlock analysis); an error in one is reported as the device's fault. The
host waits for the queue with ``synchronize`` and ``query``; a device reset drops
what is pending. While a stream captures a graph, work issued to it is recorded into
the graph instead (:mod:`.routing`); while it updates a task group, the ops issued
patch the group's tasks.
The current stream is per host thread and per device, as with torch_npu.

``Event`` has CUDA/NPU semantics: ``record`` marks the work issued to a stream
so far; ``wait`` makes a stream wait for the latest record issued before the
call; waiting on a never-recorded event does nothing. It lives here, with the
streams, because a stream makes one (``record_event``, ``wait_stream``);
``ExternalEvent``, the graph's binary flag, is in :mod:`.events`.

Captures, task-group updates and graph launches are built on streams
(:mod:`.graphs`, :mod:`.task_groups`): a stream knows them by what it asks of them,
the protocols :class:`Capture`, :class:`Update` and :class:`Launch` below.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from .device import current_device, device_index, set_current_device
from .errors import DeadlockError, DeviceFaultError, SimError, SimUsageError
from .runtime import (
    RUNTIME,
    Clock,
    CostClock,
    WaitInfo,
    clock_join,
    model_now,
    new_actor_id,
    new_event_id,
)


class Work(Protocol):
    """Something a stream executes, eagerly or as a node of a replayed graph."""

    @property
    def label(self) -> str: ...

    def run(self, ex: Stream) -> None: ...


class Capture(Protocol):
    """The capture a stream records into: a :class:`.graphs.CaptureState` (the capture
    stream's part, or a side stream's that joined it)."""

    graph: Any  # the NPUGraph being captured
    stream: Stream  # the stream whose part this is
    open_group: Any  # the task group open on this stream (task_groups.TaskGroup), or None
    nodes: list[Any]  # this stream's branch of the graph

    def add_node(self, node: Any) -> None:
        """Record ``node`` (work issued to the stream) into the graph."""

    def wait_locked(self, event: Event, stream: Stream) -> bool:
        """``event.wait(stream)`` where ``stream`` captures or ``event`` was recorded in
        this capture: done by the capture (a captured wait, or ``stream`` joins it), or
        False when it is an eager wait after all. Caller holds the runtime lock."""


class Update(Protocol):
    """The task-group update open on a stream (:class:`.task_groups.UpdateState`): the
    ops issued to the stream patch the group's tasks, in order."""

    handle: Any  # the task_groups.TaskGroupHandle being updated
    tasks: list[Any]  # the group's captured tasks
    next: int  # how many of them were re-issued so far
    begun: float  # when the update's host work began (perf_counter)

    def patch_for(self, call: Any, stream: Stream) -> Work:
        """The work that patches the next task with ``call`` (an OpCall)."""


class Launch(Protocol):
    """One replay of a graph (:class:`.graphs.Launch`), which its nodes run in."""

    graph_name: str  # the NPUGraph replayed (named, not held: it stays collectable)
    number: int  # which replay of it
    seqs: dict[Any, int]  # the event record numbers this replay issued, by captured node


class Dropped(Exception):
    """Raised inside a stream thread when its work is abandoned (fault or reset)."""


#: The clock of an entry issued in performance mode, which keeps no clocks (never written).
_NO_CLOCK: Clock = {}


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


_PRIVATEUSE1 = int(torch._C._autograd.DeviceType.PrivateUse1)  # type: ignore[call-overload]
_by_id: dict[tuple[int, int], Stream] = {}  # (device index, stream id) -> stream


class Stream(torch.Stream):
    """An in-order device queue with its own executor thread.

    Same constructor as torch_npu 2.14's ``torch_npu.npu.Stream(device=None,
    priority=0, **kwargs)``, whose keywords go to ``_NPUStreamBase`` (``priority``,
    ``stream_id``, ``device_index``, ``device_type``, ``stream_ptr``,
    ``is_sync_launch``): ``Stream(stream_id=, device_index=, device_type=)`` names an
    existing stream (as torch_npu's ``current_stream`` and npugraph_ex's converter
    build them) and returns it. A ``torch.Stream`` (as torch_npu's is), so torch takes
    it wherever it takes a stream (``Tensor.record_stream``); equality and hash are
    torch.Stream's (in C: streams key hot dicts and sets), by device and stream id.
    """

    _count = 0

    def __new__(
        cls, device: Any = None, priority: int = 0, *, _default: bool = False, **kwargs: Any
    ) -> Stream:
        named = _named_stream(device, kwargs)
        if named is not None:
            return named
        idx = device_index(device)
        if not _default:
            Stream._count += 1
        sid = 0 if _default else Stream._count
        return super().__new__(cls, stream_id=sid, device_index=idx, device_type=_PRIVATEUSE1)

    def __init__(
        self, device: Any = None, priority: int = 0, *, _default: bool = False, **kwargs: Any
    ) -> None:
        if getattr(self, "_made", False):  # an existing stream, named by its ids
            return
        self._made = True
        self.priority = priority
        self.is_default = _default
        _by_id[(self.device_index, self.stream_id)] = self
        # What work issued to the stream turns into (:mod:`.routing`).
        self.capturing: Capture | None = None
        self.updating: Update | None = None
        # The queue and its thread (torch.Stream's own __init__ does not run: __new__
        # made the C stream).
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
        with RUNTIME.cond:
            RUNTIME.streams.append(self)

    # ------------------------------------------------------------ identity
    @property
    def name(self) -> str:
        kind = "default stream" if self.is_default else f"stream {self.stream_id}"
        return f"{kind} of npu:{self.device_index}"

    @property
    def npu_stream(self) -> int:
        return id(self)

    native_handle = npu_stream  # the aclrtStream of torch.Stream.native_handle

    def is_capturing(self) -> bool:
        return self.capturing is not None

    def __enter__(self) -> Stream:  # ``with s:`` as torch.Stream: ``torch.npu.stream(s)``
        scope = _StreamScope(self)
        scope.__enter__()
        _current.scopes.append(scope)
        return self

    def __exit__(self, *exc: object) -> None:
        _current.scopes.pop().__exit__()

    def __repr__(self) -> str:  # torch_npu 2.14 npu/streams.py Stream.__repr__
        return f"<torch_npu.npu.Stream device={self.device} npu_stream={self.npu_stream:#x}>"

    # ------------------------------------------------------------ events
    def wait_event(self, event: Any) -> None:
        event.wait(self)

    def wait_stream(self, stream: Any) -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event: Any = None) -> Any:
        if event is None:
            event = Event()
        event.record(self)
        return event

    # ------------------------------------------------------------ issue
    def issue(self, work: Work) -> None:
        """Queue ``work`` (host side). Caller must not hold the runtime lock."""
        with RUNTIME.cond:
            self.issue_locked(work)

    def issue_locked(self, work: Work, model: float | None = None) -> None:
        """Queue ``work`` (host side; caller holds ``cond``). ``model``: the issuing
        host's time in the timed model when the caller knows it (default: ``model_now()``)."""
        config = RUNTIME.config
        if model is None:
            model = model_now() if config.timed else 0.0
        if config.perf and RUNTIME.fault is None:
            if not self._queue:
                run_now = getattr(work, "run_now_locked", None)
                if run_now is not None and self._ran_now_locked(work, run_now, model):
                    return
            elif (run_early := getattr(work, "run_early", None)) is not None and all(
                getattr(e.work, "inert", False) for e in self._queue
            ):
                # Performance mode: what is queued reads and writes no memory (a replay
                # is modelled time, a record a flag), so a copy run now, off the
                # stream's thread, leaves memory as the stream would leave it
                run_early()
                return
        clock = _NO_CLOCK if config.perf else RUNTIME.host_issue_clock()  # (runtime doc)
        entry = _Entry(work, clock, RUNTIME.epoch, model)
        self._queue.append(entry)
        self._last = entry
        RUNTIME.unobserved.add(self)
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._device_thread, name=f"sim-{self.name}", daemon=True
            )
            self._thread.start()
        if self._idle:  # a busy executor takes the entry without being woken
            self._wake.notify()

    def _ran_now_locked(self, work: Work, run_now: Callable[[Stream], bool], model: float) -> bool:
        """Performance mode: run ``work`` at its issue, on the issuing thread, when this
        stream has nothing queued or running (its thread is parked) and the work need not
        wait (a patch, a record, a wait already released: ``run_now(self)``, False when it
        must wait; it then changed nothing). The stream's state moves as its thread would
        move it, at the same modelled time; what is saved is the thread's wake-up, its
        critical section and its share of the interpreter lock: device work that costs
        the host nothing, as on an NPU, where such an entry costs no host thread at all.
        Caller holds ``cond``."""
        if model > self.model_time:  # it could not start before its issue
            self.model_time = model
        self.resume_at = None
        if not run_now(self):
            return False
        entry = _Entry(work, _NO_CLOCK, RUNTIME.epoch, model)
        # The stream's clock itself, not a copy: performance mode keeps no clocks (the
        # runtime's doc); leaving it, a host that observes this entry takes later ticks
        # of the stream too, which orders more, never less.
        entry.done, entry.done_clock, entry.done_at = True, self.clock, self.model_time
        self._last = entry
        RUNTIME.unobserved.add(self)
        return True

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

    def advance(self) -> None:
        """The stream's modelled time moves past the device time charged so far without
        waiting for it in wall time (performance mode, before a node nothing observes)."""
        end = self.cost.end
        if end > self.model_time:
            self.model_time = end

    def timed_now(self) -> float:
        """When this stream's current work happens: in timed mode its modelled time (its
        entry's issue in the host's model, the waits it passed, the device time it was
        charged), which leaves out the simulator's own delays in getting to it; in
        compute mode the wall clock."""
        if RUNTIME.config.timed:
            return self.model_time
        return time.perf_counter()

    def _device_thread(self) -> None:
        """The executor thread. Device work runs under ``torch.inference_mode()``: the
        CPU tensors it reads and writes are device memory, below autograd, and may be
        inference tensors (memory allocated, or host tensors made, while the program's
        thread was in inference mode). Outside that mode, an in-place write to them
        fails ("Inplace update to inference tensor outside InferenceMode"), where the NPU
        writes device memory whatever the mode of the thread that issued the work
        (``inference_mode`` is a per-thread state of the host; vLLM runs its model
        under it)."""
        with torch.inference_mode():
            self._loop()

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
                    entry.work.run(self)
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
        # (performance mode: the clock itself, as _ran_now_locked's)
        entry.done_clock = self.clock if RUNTIME.config.perf else dict(self.clock)
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
                RUNTIME.blocked.add(self)
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
                RUNTIME.unobserved.discard(self)
                return
            RUNTIME.wait_until(lambda: target.done, f"{self.name} to finish")
            self._observed_locked(target)

    def query(self) -> bool:
        with RUNTIME.cond:
            RUNTIME.raise_if_faulted()
            target = self._last
            if target is None:
                return True
            if target.done:
                self._observed_locked(target)
            return target.done

    def _observed_locked(self, target: _Entry) -> None:
        """The host saw ``target``, an entry of this stream, finished."""
        RUNTIME.host_join(target.done_clock, target.done_at)
        if target is self._last:
            RUNTIME.unobserved.discard(self)

    def finished_clock_locked(self) -> Clock | None:
        last = self._last
        return last.done_clock if last is not None and last.done else None

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


#: The keywords torch_npu's ``_NPUStreamBase`` takes (Stream.cpp's kwlist).
_BASE_KEYWORDS = ("priority", "stream_id", "device_index", "device_type", "stream_ptr",
                  "is_sync_launch")  # fmt: skip


def _named_stream(device: Any, kwargs: dict[str, Any]) -> Stream | None:
    """The existing stream ``Stream(stream_id=, device_index=, device_type=)`` names, or
    None for a new stream; refuses what ``_NPUStreamBase`` refuses."""
    for key in kwargs:
        if key not in _BASE_KEYWORDS or key == "priority":
            raise TypeError(f"Stream() got an unexpected keyword argument {key!r}")
    if kwargs.get("stream_ptr") or kwargs.get("is_sync_launch"):
        raise SimUsageError(
            "Stream(stream_ptr=...) and SyncLaunchStream are not modelled by the simulated NPU"
        )
    if "stream_id" not in kwargs and "device_index" not in kwargs:
        return None
    sid = int(kwargs.get("stream_id", 0))
    idx = device_index(kwargs.get("device_index", device))
    kind = kwargs.get("device_type")
    if kind is not None and int(kind) != _PRIVATEUSE1:
        raise SimUsageError(f"Stream(device_type={kind}) is not an npu stream")
    if sid == 0:
        return default_stream(idx)
    found = _by_id.get((idx, sid))
    if found is None:
        raise SimUsageError(f"npu:{idx} has no stream with stream_id {sid}")
    return found


# ---------------------------------------------------------------- current stream
class _Current(threading.local):
    def __init__(self) -> None:
        self.streams: dict[int, Stream] = {}
        self.scopes: list[_StreamScope] = []  # ``with stream:`` blocks


_current = _Current()
_defaults: dict[int, Stream] = {}
_defaults_lock = threading.Lock()


def default_stream(device: Any = None) -> Stream:
    idx = device_index(device)
    with _defaults_lock:
        s = _defaults.get(idx)
        if s is None:
            s = _defaults[idx] = Stream(idx, _default=True)
        return s


#: The streams current where each running backward pass was called (innermost last):
#: autograd runs a device's backward ops on an engine thread of its own, which has no
#: current stream; :mod:`.backward_streams` pushes and pops these.
BACKWARD_AMBIENT: list[dict[int, Stream]] = []


def current_stream(device: Any = None) -> Stream:
    idx = device_index(device)
    s = _current.streams.get(idx)
    if s is not None:
        return s
    if BACKWARD_AMBIENT and torch._C._current_autograd_node() is not None:
        s = BACKWARD_AMBIENT[-1].get(idx)
        if s is not None:
            return s
    return default_stream(idx)


def as_stream(s: Any) -> Stream:
    """The sim stream ``s`` is: a sim Stream, or a ``torch.Stream`` of an npu stream."""
    if isinstance(s, Stream):
        return s
    if isinstance(s, torch.Stream) and s.device.type == "npu":
        if s.stream_id == 0:
            return default_stream(s.device_index)
        found = _by_id.get((s.device_index, s.stream_id))
        if found is not None:
            return found
    raise TypeError(f"expected an npu stream (torch.npu.Stream), got {s!r}")


def set_stream(stream: Stream) -> None:
    if type(stream) is not Stream:
        stream = as_stream(stream)
    _current.streams[stream.device_index] = stream
    set_current_device(stream.device_index)


class _StreamScope:
    """What :func:`stream` returns (a class, not a generator: it is on every patch's path)."""

    __slots__ = ("prev", "prev_device", "s")

    def __init__(self, s: Stream | None) -> None:
        self.s = s if s is None or type(s) is Stream else as_stream(s)

    def __enter__(self) -> Stream | None:
        s = self.s
        if s is not None:
            self.prev_device = current_device()
            self.prev = _current.streams.get(s.device_index)
            set_stream(s)
        return s

    def __exit__(self, *exc: object) -> None:
        s = self.s
        if s is None:
            return
        if self.prev is None:
            _current.streams.pop(s.device_index, None)
        else:
            _current.streams[s.device_index] = self.prev
        set_current_device(self.prev_device)


def stream(stream: Stream | None) -> AbstractContextManager[Stream | None]:
    """Make ``stream`` the current stream (and its device current) inside the block
    (torch_npu's ``torch.npu.stream(stream)``; None: no-op)."""
    return _StreamScope(stream)


# =================================================================== Event
def _stream_of(stream: Stream | None) -> Stream:
    return stream if stream is not None else current_stream()


class Event:
    """``torch_npu.npu.Event(enable_timing=False, blocking=False, interprocess=False)``."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self.enable_timing = enable_timing
        self.name = f"Event#{new_event_id()}"
        self._issued = 0  # records issued (host side)
        self._done = 0  # records that ran
        self._clocks: dict[int, Clock] = {}
        self._providers: dict[int, Stream] = {}
        self._times: dict[int, float] = {}
        self._captured_in: Any = None  # graph whose capture holds the latest record
        self._captured_at: Any = None  # (capture state, node) of that record

    def __repr__(self) -> str:  # torch_npu 2.14 npu/streams.py: created by the first record
        if self._issued or self._captured_at is not None:
            return f"<torch_npu.npu.Event {self.npu_event:#x}>"
        return "<torch_npu.npu.Event uninitialized>"

    @property
    def npu_event(self) -> int:
        return id(self)

    # -------------------------------------------------------------- host API
    def record(self, stream: Stream | None = None) -> None:
        s = _stream_of(stream)
        with RUNTIME.cond:
            cap = s.capturing
            if cap is not None:
                node = EventRecordWork(self, None)
                cap.add_node(node)
                self._captured_in, self._captured_at = cap.graph, (cap, node)
                return
            self._captured_in = None
            seq = self.issue_record_locked(s)
            s.issue_locked(EventRecordWork(self, seq))

    def issue_record_locked(self, provider: Stream) -> int:
        self._issued += 1
        self._providers[self._issued] = provider
        return self._issued

    def wait(self, stream: Stream | None = None) -> None:
        s = _stream_of(stream)
        with RUNTIME.cond:
            cap = s.capturing
            if cap is None and self._captured_in is not None:
                cap = self._captured_in.capturing  # recorded in a capture that may be live
            if cap is not None and cap.wait_locked(self, s):  # captured, or a fork (forkjoin)
                return
            seq = self._issued
            if seq == 0:
                return  # waiting on a never-recorded event is a no-op
            s.issue_locked(EventWaitWork(self, seq))

    def query(self) -> bool:
        with RUNTIME.cond:
            RUNTIME.raise_if_faulted()
            seq = self._issued
            if self._done >= seq:
                if seq:
                    RUNTIME.host_join(self._clocks[seq], self._times[seq])
                return True
            return False

    def synchronize(self) -> None:
        with RUNTIME.cond:
            RUNTIME.raise_if_faulted()
            seq = self._issued
            if seq == 0:
                return
            RUNTIME.wait_until(lambda: self._done >= seq, f"{self.name} to complete")
            RUNTIME.host_join(self._clocks[seq], self._times[seq])

    def elapsed_time(self, end_event: Event) -> float:
        if not (self.enable_timing and end_event.enable_timing):
            raise SimUsageError("elapsed_time needs both events created with enable_timing=True")
        with RUNTIME.cond:
            a, b = self._issued, end_event._issued
            if a == 0 or b == 0 or self._done < a or end_event._done < b:
                raise SimUsageError("elapsed_time needs both events recorded and completed")
            return (end_event._times[b] - self._times[a]) * 1000.0

    # -------------------------------------------------------------- device side
    def complete_locked(self, seq: int, clock: Clock, at: float | None = None) -> None:
        self._clocks[seq] = clock if RUNTIME.config.perf else dict(clock)  # (runtime doc)
        self._times[seq] = time.perf_counter() if at is None else at
        self._providers.pop(seq, None)
        if seq > self._done:
            self._done = seq
        # Older clocks are no longer needed once a later record completed.
        for old in [k for k in self._clocks if k < seq - 4]:
            del self._clocks[old]
        RUNTIME.wake_locked()


class EventRecordWork:
    """Record of an Event: eager (``seq`` given) or a graph node (seq per launch)."""

    inert = True  # reads and writes no memory (Stream.issue_locked)

    def __init__(self, event: Event, seq: int | None) -> None:
        self.event = event
        self.seq = seq
        self.label = f"record {event.name}"

    def launch_locked(self, launch: Launch, stream: Stream) -> None:
        launch.seqs[self] = self.event.issue_record_locked(stream)

    def run(self, ex: Stream, launch: Launch | None = None) -> None:
        seq = self.seq if launch is None else launch.seqs[self]
        assert seq is not None
        ex.tick()
        with RUNTIME.cond:
            self.event.complete_locked(seq, ex.clock, ex.timed_now())

    def run_now_locked(self, ex: Stream) -> bool:
        """Performance mode: the record at its issue (``Stream.issue_locked``)."""
        assert self.seq is not None
        ex.tick()
        self.event.complete_locked(self.seq, ex.clock, ex.timed_now())
        return True


class _EventWait:
    def __init__(self, event: Event, seq: int) -> None:
        self.event, self.seq = event, seq

    def providers(self) -> list[Stream]:
        p = self.event._providers.get(self.seq)
        return [p] if p is not None else []

    def ready(self) -> bool:
        return self.event._done >= self.seq

    def describe(self) -> str:
        p = self.providers()
        by = f" (queued on {p[0].name})" if p else ""
        return f"record #{self.seq} of {self.event.name}{by}"


class EventWaitWork:
    def __init__(self, event: Event, seq: int) -> None:
        self.event = event
        self.seq = seq
        self.label = f"wait {event.name}"

    def run(self, ex: Stream, launch: Launch | None = None) -> None:
        ev, seq = self.event, self.seq
        began = ex.timed_now()
        with RUNTIME.cond:
            ex.block_until(lambda: ev._done >= seq, _EventWait(ev, seq), ex.run_epoch)
            self._passed_locked(ex, began)
        ex.tick()

    def _passed_locked(self, ex: Stream, began: float) -> None:
        ev, seq = self.event, self.seq
        clock = ev._clocks.get(seq)
        if clock is not None and not RUNTIME.config.perf:  # (no clocks: runtime doc)
            clock_join(ex.clock, clock)
        ex.resume(max(began, ev._times.get(seq, began)))

    def run_now_locked(self, ex: Stream) -> bool:
        """Performance mode: the wait at its issue when its record ran already."""
        if self.event._done < self.seq:
            return False
        self._passed_locked(ex, ex.timed_now())
        ex.tick()
        return True
