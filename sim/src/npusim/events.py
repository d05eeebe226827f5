"""The ExternalEvent of the simulated NPU (``Event`` is in :mod:`.streams`).

``ExternalEvent`` has the semantics of torch_npu 2.14 on current CANN: a binary
flag. ``record`` sets it; a ``wait`` blocks until it is set and then clears it
(auto-reset), so a wait may be issued before its record. Two records before one
consuming wait merge into one signal: the second release is lost, and the next
wait hangs. The simulator reports such a record as a HazardError as soon as it
runs, whether or not the timing of this run happened to lose it: a record must
be ordered (happen-before) after the wait that consumed the previous record.
``reset(stream)`` is a task on ``stream`` (a node when captured; like every
non-kernel task it is refused inside a task group); on current CANN it finds
the flag already cleared by the wait before it and changes nothing (a release
recorded since is kept).

With ``configure(event_mode="legacy")`` the sim models older CANN, where a wait
does not clear the flag: only ``reset`` does. A captured wait must then be
followed by ``reset`` on the same stream (as torch_npu's own capture paths do),
or the flag stays set: the next record is reported as a lost release, and the
next replay's wait passes on the stale flag (its task groups race the patch).

With ``configure(event_mode="enpu")`` the sim models ENPU, where an ExternalEvent
must be recorded before it is waited on (vllm-ascend #8636, #8317, #8354): a wait
issued (eagerly, or by launching a replay that holds it) when no record issued
before it is left to release it is reported as a HazardError of kind
"wait-before-record" (on the device it hangs).
"""

from __future__ import annotations

from .errors import HazardError, SimUsageError
from .runtime import RUNTIME, Clock, clock_join, clock_leq, new_event_id
from .streams import Launch, Stream, current_stream


def _stream_of(stream: Stream | None) -> Stream:
    return stream if stream is not None else current_stream()


# =================================================================== ExternalEvent
class ExternalEvent:
    """``torch_npu.npu.ExternalEvent()``: a binary flag that graph waits consume."""

    def __init__(self) -> None:
        self.name = f"ExternalEvent#{new_event_id()}"
        self.flag = False
        self.pending: dict[Stream, int] = {}  # records issued, not yet run, per stream
        self._record_clock: Clock = {}
        self._record_by: tuple[Stream | None, Launch | None] = (None, None)
        self._consume_clock: Clock | None = None
        self._consumed_by = ""
        self._host_waits = 0  # host wait() calls since the last host record()
        self._set_at = 0.0  # perf_counter() of the record that set the flag
        self.label = ""  # set by code that knows what the event guards (for messages)
        self.waited_in = ""  # the graph whose capture holds a wait on it (for messages)
        # Issue order (ENPU mode): records and waits issued, eager or by replay launches.
        self.records_issued = 0
        self.waits_issued = 0
        self._created = False  # torch_npu creates the event at its first record or wait

    def __repr__(self) -> str:  # torch_npu 2.14 npu/streams.py ExternalEvent.__repr__
        if self._created:
            return f"<torch_npu.npu.ExternalEvent {self.npu_event:#x}>"
        return "<torch_npu.npu.ExternalEvent uninitialized>"

    @property
    def npu_event(self) -> int:
        return id(self)

    @property
    def display(self) -> str:
        return f"{self.name} ({self.label})" if self.label else self.name

    @property
    def guarded(self) -> str:
        """The event and, when a captured graph waits on it, where."""
        return f"{self.display}, waited on in {self.waited_in}," if self.waited_in else self.display

    def record(self, stream: Stream | None = None) -> None:
        s = _stream_of(stream)
        self._created = True
        with RUNTIME.cond:
            if s.capturing is not None:
                s.capturing.add_node(ExtRecordWork(self))
                self._host_waits = 0
                return
            s.issue_locked(self.record_issued_locked(s))
            RUNTIME.provider_added_locked(s)

    def record_issued_locked(self, s: Stream) -> ExtRecordWork:
        """The bookkeeping of an eager record on ``s`` (not capturing), issued by the
        caller: the work that sets the flag when ``s`` runs it. Caller holds ``cond``."""
        self._created = True
        self._host_waits = 0
        self.add_pending_locked(s)
        self.records_issued += 1
        return ExtRecordWork(self)

    def wait(self, stream: Stream | None = None) -> None:
        s = _stream_of(stream)
        self._created = True
        with RUNTIME.cond:
            if self._host_waits:  # torch_npu's is_waited_, cleared only by record()
                raise SimUsageError(
                    "External event: A single record operation cannot be associated with "
                    f"multiple wait operations. ({self.display}.wait() called again without a "
                    "record() between, counting waits captured in graphs since reset: an "
                    "ExternalEvent is a binary flag that each wait consumes, so the second "
                    "wait could never be released)"
                )
            if s.capturing is not None:
                graph = s.capturing.graph
                s.capturing.add_node(ExtWaitWork(self))
                self._host_waits += 1
                self.waited_in = f"{graph.name} (before task group {len(graph.groups)})"
                return
            self._host_waits += 1
            self.wait_issued_locked(f"on {s.name}")
            s.issue_locked(ExtWaitWork(self))

    def reset(self, stream: Stream | None = None) -> None:
        """Clear the flag, in ``stream``'s order (captured: a node of the graph). Current
        CANN's wait has cleared it already; on older CANN (``event_mode="legacy"``) this
        is what consumes the record a wait passed on."""
        s = _stream_of(stream)
        with RUNTIME.cond:
            if s.capturing is not None:
                s.capturing.add_node(ExtResetWork(self))  # refused inside a task group
                return
            s.issue_locked(ExtResetWork(self))

    def wait_issued_locked(self, where: str) -> None:
        """A wait on this event is issued now. In ENPU mode, report it when no record
        issued before it is left to release it."""
        self.waits_issued += 1
        if RUNTIME.config.event_mode == "enpu" and self.waits_issued > self.records_issued:
            self.waits_issued = self.records_issued  # one report per missing record
            RUNTIME.report(
                HazardError(
                    f"wait before record: a wait on {self.guarded} was issued {where} before "
                    "any record that could release it. On ENPU an ExternalEvent must be "
                    "recorded before it is waited on, or the wait hangs: issue the record "
                    "(the update) before launching the replay that waits on it "
                    "(event_mode='enpu').",
                    kind="wait-before-record",
                )
            )

    def consumed_locked(self, ex: Stream, launch: Launch | None) -> None:
        """The record that set the flag is consumed on ``ex`` (its next may follow)."""
        # (performance mode keeps no clocks, and checks no record against this one)
        self._consume_clock = ex.clock if RUNTIME.config.perf else dict(ex.clock)
        where = ex.name if launch is None else f"{ex.name} in a replay of {launch.graph_name}"
        self._consumed_by = where

    def add_pending_locked(self, s: Stream) -> None:
        self.pending[s] = self.pending.get(s, 0) + 1

    def _done_pending_locked(self, s: Stream) -> None:
        n = self.pending.get(s, 0) - 1
        if n > 0:
            self.pending[s] = n
        else:
            self.pending.pop(s, None)


class ExtRecordWork:
    inert = True  # reads and writes no memory (Stream.issue_locked)

    def __init__(self, event: ExternalEvent) -> None:
        self.event = event

    @property
    def label(self) -> str:
        return f"record {self.event.name}"

    def launch_locked(self, launch: Launch, stream: Stream) -> None:
        self.event.add_pending_locked(stream)
        self.event.records_issued += 1

    def run(self, ex: Stream, launch: Launch | None = None) -> None:
        ex.tick()
        with RUNTIME.cond:
            self._set_locked(ex, launch)

    def run_now_locked(self, ex: Stream) -> bool:
        """Performance mode: the record at its issue (``Stream.issue_locked``)."""
        ex.tick()
        self._set_locked(ex, None)
        return True

    def _set_locked(self, ex: Stream, launch: Launch | None) -> None:
        ev = self.event
        ev._done_pending_locked(ex)
        if ev.flag:
            RUNTIME.report(
                HazardError(
                    f"lost release: record of {ev.guarded} on {_where(ex, launch)} ran while "
                    f"the previous record (by {_where(*ev._record_by)}) was still unconsumed; "
                    "the two merge into one signal and the next wait on it hangs. Record once "
                    "per captured wait, after the replay that consumed the previous record.",
                    kind="lost-release",
                )
            )
            return
        if (
            ev._consume_clock is not None
            and not RUNTIME.config.perf  # performance mode checks no ordering
            and not clock_leq(ev._consume_clock, ex.clock)
        ):
            RUNTIME.report(
                HazardError(
                    f"lost release: record of {ev.guarded} on {_where(ex, launch)} is not "
                    f"ordered after the wait that consumed the previous record "
                    f"({ev._consumed_by}); whenever it runs first, the two records merge and "
                    "the next wait hangs. Make the recording stream wait for an event recorded "
                    "after that replay.",
                    kind="lost-release",
                )
            )
            return
        ev.flag = True
        ev._set_at = ex.timed_now()
        # Performance mode keeps no clocks (runtime doc): the stream's clock itself (later
        # ticks of it order more, never less), not a copy of every actor's entry.
        ev._record_clock = ex.clock if RUNTIME.config.perf else dict(ex.clock)
        ev._record_by = (ex, launch)  # formatted only for a report
        RUNTIME.wake_locked()


def _where(ex: Stream | None, launch: Launch | None) -> str:
    """Where a record ran, for a report."""
    if ex is None:
        return "nothing"
    return ex.name if launch is None else f"{ex.name} in a replay of {launch.graph_name}"


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


class _ExtWaitAll:
    """Several ExternalEvents' records, waited for at once (performance mode)."""

    def __init__(self, events: list[ExternalEvent]) -> None:
        self.events = events
        self._set = 0  # the events before this one are set (no one clears them meanwhile)

    def providers(self) -> list[Stream]:
        return list({s: None for ev in self.events if not ev.flag for s in ev.pending})

    def ready(self) -> bool:
        # Only the waiting stream clears these flags, after the wait: a flag seen set
        # stays set while it waits, so each is looked at until it is set, not at every
        # wake-up (a record wakes the waiters: 20 layers' records would cost 20 x 20).
        events, i = self.events, self._set
        while i < len(events) and events[i].flag:
            i += 1
        self._set = i
        return i == len(events)

    def describe(self) -> str:
        unset = [ev.display for ev in self.events if not ev.flag]
        return f"records of {', '.join(unset)}"


def await_records(ex: Stream, events: list[ExternalEvent]) -> None:
    """Stream ``ex`` blocks until every one of ``events`` is set: one wake-up for a replay's
    stretch of waits with nothing observable between them (performance mode: see
    ``graphs._run_perf``); the waits then pass in order, each at its record's time."""
    wait = _ExtWaitAll(events)
    with RUNTIME.cond:
        ex.block_until(wait.ready, wait, ex.run_epoch)


class ExtWaitWork:
    def __init__(self, event: ExternalEvent) -> None:
        self.event = event
        self.label = f"wait {event.name}"

    def launch_locked(self, launch: Launch, stream: Stream) -> None:
        self.event.wait_issued_locked(f"by replay #{launch.number} of {launch.graph_name}")

    def run(self, ex: Stream, launch: Launch | None = None) -> None:
        ev = self.event
        began = ex.timed_now()
        with RUNTIME.cond:
            ex.block_until(lambda: ev.flag, _ExtWait(ev), ex.run_epoch)
            self.passed_locked(ex, launch, began)

    def passed_locked(self, ex: Stream, launch: Launch | None, began: float) -> None:
        """The wait passes on ``ex``, its event set, having begun at modelled ``began``.
        Caller holds ``cond``."""
        ev = self.event
        ex.resume(max(began, ev._set_at))  # when the device could go on
        if not RUNTIME.config.perf:  # (no clocks: runtime doc)
            clock_join(ex.clock, ev._record_clock)
        ex.tick()
        if RUNTIME.config.event_mode != "legacy":  # older CANN: only reset clears it
            ev.flag = False
            ev.consumed_locked(ex, launch)


class ExtResetWork:
    """``ExternalEvent.reset(stream)``: clears the flag when the stream reaches it."""

    def __init__(self, event: ExternalEvent) -> None:
        self.event = event
        self.label = f"reset {event.name}"

    def launch_locked(self, launch: Launch, stream: Stream) -> None:
        pass

    def run(self, ex: Stream, launch: Launch | None = None) -> None:
        ex.tick()
        with RUNTIME.cond:
            self.ran_locked(ex, launch)

    def ran_locked(self, ex: Stream, launch: Launch | None) -> None:
        """The reset runs on ``ex`` (ticked already). Caller holds ``cond``."""
        ev = self.event
        # Older CANN: the record the wait before passed on is consumed here. (Current
        # CANN's wait consumed it; a release recorded since is left alone, as before.)
        if ev.flag and RUNTIME.config.event_mode == "legacy":
            ev.flag = False
            ev.consumed_locked(ex, launch)
