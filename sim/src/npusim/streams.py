"""Streams and events of the simulated NPU.

A stream is an in-order queue executed by its own thread, asynchronously to
the host and to the other streams (:mod:`.executor`). Work is issued by host
threads; while a stream captures a graph, work issued to it is recorded into the
graph instead.
The current stream is per host thread and per device, as with torch_npu.

``Event`` has CUDA/NPU semantics: ``record`` marks the work issued to a stream
so far; ``wait`` makes a stream wait for the latest record issued before the
call; waiting on a never-recorded event does nothing. It lives here, with the
streams, because a stream makes one (``record_event``, ``wait_stream``);
``ExternalEvent``, the graph's binary flag, is in :mod:`.events`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from .device import current_device, device_index, set_current_device
from .errors import SimUsageError
from .executor import StreamExecutor
from .runtime import RUNTIME, Clock, clock_join, new_event_id

if TYPE_CHECKING:
    from .graphs import CaptureState, Launch
    from .task_groups import UpdateState


_PRIVATEUSE1 = int(torch._C._autograd.DeviceType.PrivateUse1)  # type: ignore[call-overload]
_by_id: dict[tuple[int, int], Stream] = {}  # (device index, stream id) -> stream


class Stream(StreamExecutor, torch.Stream):
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
        super().__init__()  # the queue and its executor thread (StreamExecutor)
        self.capturing: CaptureState | None = None
        self.updating: UpdateState | None = None
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


def current_stream(device: Any = None) -> Stream:
    idx = device_index(device)
    s = _current.streams.get(idx)
    return s if s is not None else default_stream(idx)


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

    #: A wait that involves a capture (set by :mod:`.forkjoin`, which imports this module).
    capture_wait: Callable[[Event, Stream], bool]

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
            graph = self._captured_in
            if (
                s.capturing is not None or (graph is not None and graph.capturing is not None)
            ) and Event.capture_wait(self, s):  # in a capture, or a fork (forkjoin.py)
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
                    RUNTIME.host_join(self._clocks[seq])
                return True
            return False

    def synchronize(self) -> None:
        with RUNTIME.cond:
            RUNTIME.raise_if_faulted()
            seq = self._issued
            if seq == 0:
                return
            RUNTIME.wait_until(lambda: self._done >= seq, f"{self.name} to complete")
            RUNTIME.host_join(self._clocks[seq])

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
        self._clocks[seq] = dict(clock)
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
            clock = ev._clocks.get(seq)
            if clock is not None:
                clock_join(ex.clock, clock)
            ex.resume(max(began, ev._times.get(seq, began)))
        ex.tick()
