"""Events of the simulated NPU.

``Event`` has CUDA/NPU semantics: ``record`` marks the work issued to a stream
so far; ``wait`` makes a stream wait for the latest record issued before the
call; waiting on a never-recorded event does nothing.

``ExternalEvent`` has the semantics of torch_npu 2.14 on current CANN: a binary
flag. ``record`` sets it; a ``wait`` blocks until it is set and then clears it
(auto-reset), so a wait may be issued before its record. Two records before one
consuming wait merge into one signal: the second release is lost, and the next
wait hangs. The simulator reports such a record as a HazardError as soon as it
runs, whether or not the timing of this run happened to lose it: a record must
be ordered (happen-before) after the wait that consumed the previous record.
``reset()`` is accepted and does nothing, as on current CANN.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Any

from .errors import HazardError, SimUsageError
from .runtime import RUNTIME, Clock, clock_join, clock_leq
from .streams import Stream, current_stream

if TYPE_CHECKING:
    from .graphs import Launch

_event_ids = itertools.count(1)


def _stream_of(stream: Stream | None) -> Stream:
    return stream if stream is not None else current_stream()


# =================================================================== Event
class Event:
    """``torch_npu.npu.Event(enable_timing=False, blocking=False, interprocess=False)``."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self.enable_timing = enable_timing
        self.name = f"Event#{next(_event_ids)}"
        self._issued = 0  # records issued (host side)
        self._done = 0  # records that ran
        self._clocks: dict[int, Clock] = {}
        self._providers: dict[int, Stream] = {}
        self._times: dict[int, float] = {}
        self._captured_in: Any = None  # graph whose capture holds the latest record

    def __repr__(self) -> str:
        return f"<graphlane sim {self.name}>"

    @property
    def npu_event(self) -> int:
        return id(self)

    # -------------------------------------------------------------- host API
    def record(self, stream: Stream | None = None) -> None:
        s = _stream_of(stream)
        with RUNTIME.cond:
            if s.capturing is not None:
                self._captured_in = s.capturing.graph
                s.capturing.add_node(EventRecordWork(self, None))
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
            if s.capturing is not None:
                if self._captured_in is not s.capturing.graph:
                    raise SimUsageError(
                        f"{self.name}.wait() on {s.name} while it captures: the event was not "
                        "recorded in the same capture (capture isolation; record it on the "
                        "capturing stream first)"
                    )
                # Same stream, same capture: already ordered by the stream.
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
    def complete_locked(self, seq: int, clock: Clock) -> None:
        self._clocks[seq] = dict(clock)
        self._times[seq] = time.perf_counter()
        self._providers.pop(seq, None)
        if seq > self._done:
            self._done = seq
        # Older clocks are no longer needed once a later record completed.
        for old in [k for k in self._clocks if k < seq - 4]:
            del self._clocks[old]
        RUNTIME.cond.notify_all()


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
            self.event.complete_locked(seq, ex.clock)


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
        with RUNTIME.cond:
            ex.block_until(lambda: ev._done >= seq, _EventWait(ev, seq), RUNTIME.epoch)
            clock = ev._clocks.get(seq)
            if clock is not None:
                clock_join(ex.clock, clock)
        ex.tick()


# =================================================================== ExternalEvent
class ExternalEvent:
    """``torch_npu.npu.ExternalEvent()``: a binary flag that graph waits consume."""

    def __init__(self) -> None:
        self.name = f"ExternalEvent#{next(_event_ids)}"
        self.flag = False
        self.pending: dict[Stream, int] = {}  # records issued, not yet run, per stream
        self._record_clock: Clock = {}
        self._record_by = ""
        self._consume_clock: Clock | None = None
        self._consumed_by = ""
        self._host_waits = 0  # host wait() calls since the last host record()
        self.label = ""  # set by code that knows what the event guards (for messages)

    def __repr__(self) -> str:
        return f"<graphlane sim {self.name}>"

    @property
    def npu_event(self) -> int:
        return id(self)

    @property
    def display(self) -> str:
        return f"{self.name} ({self.label})" if self.label else self.name

    def record(self, stream: Stream | None = None) -> None:
        s = _stream_of(stream)
        with RUNTIME.cond:
            self._host_waits = 0
            if s.capturing is not None:
                s.capturing.add_node(ExtRecordWork(self))
                return
            self.add_pending_locked(s)
            s.issue_locked(ExtRecordWork(self))
            RUNTIME.check_deadlock()

    def wait(self, stream: Stream | None = None) -> None:
        s = _stream_of(stream)
        with RUNTIME.cond:
            if self._host_waits:
                raise SimUsageError(
                    f"{self.display}.wait() called twice without a record() between: an "
                    "ExternalEvent is a binary flag that each wait consumes, so the second "
                    "wait could never be released"
                )
            self._host_waits += 1
            if s.capturing is not None:
                s.capturing.add_node(ExtWaitWork(self))
                return
            s.issue_locked(ExtWaitWork(self))

    def reset(self, stream: Stream | None = None) -> None:
        """Accepted and harmless: current CANN clears the flag in the consuming wait."""
        _stream_of(stream)

    def forget_capture_locked(self) -> None:
        """The graph that held this event's wait was reset: a new capture may wait again."""
        self._host_waits = 0

    def add_pending_locked(self, s: Stream) -> None:
        self.pending[s] = self.pending.get(s, 0) + 1

    def _done_pending_locked(self, s: Stream) -> None:
        n = self.pending.get(s, 0) - 1
        if n > 0:
            self.pending[s] = n
        else:
            self.pending.pop(s, None)


class ExtRecordWork:
    def __init__(self, event: ExternalEvent) -> None:
        self.event = event
        self.label = f"record {event.name}"

    def launch_locked(self, launch: Launch, stream: Stream) -> None:
        self.event.add_pending_locked(stream)

    def run(self, ex: Stream, launch: Launch | None = None) -> None:
        ev = self.event
        ex.tick()
        where = ex.name if launch is None else f"{ex.name} in a replay of {launch.graph.name}"
        with RUNTIME.cond:
            ev._done_pending_locked(ex)
            if ev.flag:
                RUNTIME.report(
                    HazardError(
                        f"lost release: record of {ev.display} on {where} ran while the previous "
                        f"record (by {ev._record_by}) was still unconsumed; the two merge into "
                        "one signal and the next wait on it hangs. Record once per captured "
                        "wait, after the replay that consumed the previous record.",
                        kind="lost-release",
                    )
                )
                return
            if ev._consume_clock is not None and not clock_leq(ev._consume_clock, ex.clock):
                RUNTIME.report(
                    HazardError(
                        f"lost release: record of {ev.display} on {where} is not ordered after "
                        f"the wait that consumed the previous record ({ev._consumed_by}); "
                        "whenever it runs first, the two records merge and the next wait hangs. "
                        "Make the recording stream wait for an event recorded after that replay.",
                        kind="lost-release",
                    )
                )
                return
            ev.flag = True
            ev._record_clock = dict(ex.clock)
            ev._record_by = where
            RUNTIME.cond.notify_all()


class _ExtWait:
    def __init__(self, event: ExternalEvent) -> None:
        self.event = event

    def providers(self) -> list[Stream]:
        return list(self.event.pending)

    def ready(self) -> bool:
        return self.event.flag

    def describe(self) -> str:
        p = self.providers()
        by = f", pending on {', '.join(s.name for s in p)}" if p else ", none pending"
        return f"a record of {self.event.display}{by}"


class ExtWaitWork:
    def __init__(self, event: ExternalEvent) -> None:
        self.event = event
        self.label = f"wait {event.name}"

    def launch_locked(self, launch: Launch, stream: Stream) -> None:
        pass

    def run(self, ex: Stream, launch: Launch | None = None) -> None:
        ev = self.event
        with RUNTIME.cond:
            ex.block_until(lambda: ev.flag, _ExtWait(ev), RUNTIME.epoch)
            ev.flag = False
            clock_join(ex.clock, ev._record_clock)
            ex.tick()
            ev._consume_clock = dict(ex.clock)
            where = ex.name if launch is None else f"{ex.name} in a replay of {launch.graph.name}"
            ev._consumed_by = where
