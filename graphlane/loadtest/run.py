"""One run of the load test, as its drivers (:mod:`.calls`, :mod:`.batching`) share it:
the client, the recorder, when sending ends, and :func:`send`, the one place a step is
sent, timed and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from graphlane.client import Client, StepReply
from graphlane.protocol.errors import GraphlaneError

from .config import LoadConfig
from .record import Recorder
from .workload import Call

#: Error codes of the load generator itself (never on the wire).
CLIENT_OVERLOAD = "CLIENT_OVERLOAD"
CLIENT_DEADLINE = "CLIENT_DEADLINE"
#: After a stop (Ctrl-C), the most the calls in flight get before they are abandoned
#: (cancelled, counted as CLIENT_DEADLINE): a stop ends the run within a second,
#: whatever ``timeout_s`` says.
STOP_DRAIN_S = 0.5


@dataclass
class Run:
    config: LoadConfig
    client: Client
    rec: Recorder
    stop_at: float
    stop: asyncio.Event
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)  # every task of the run
    sent_until: float | None = None  # when sending ended (stop_at, or earlier when stopped)
    verify: float = 0.0  # the share of steps checked
    #: the workload's own figures, added to the report (see :mod:`.report`)
    extra: dict[str, Any] = field(default_factory=dict)

    def sending(self) -> bool:
        return self.sent_until is None and not self.stop.is_set()

    def phase(self) -> str:
        return "sending" if self.sent_until is None else "waiting for calls in flight"

    async def pause(self, seconds: float) -> None:
        """Sleep, waking up early if the run is stopped."""
        if seconds <= 0.05 or self.stop.is_set():
            await asyncio.sleep(max(0.0, seconds))
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), seconds)

    def end_sending(self) -> None:
        if self.sent_until is None:
            now = time.monotonic()
            self.sent_until = now if self.stop.is_set() else min(now, self.stop_at)


async def send(
    run: Run, call: Call, output: str, scheduled: float, *, reraise: bool = False
) -> StepReply | None:
    """Send ``call`` asking for ``output`` and record it: its latency from ``scheduled``,
    or its error by code (then None; with ``reraise``, the error is raised once recorded,
    and STATE_LOST is raised unrecorded: the caller recovers from it)."""
    rec = run.rec
    sent = time.monotonic()
    rec.sent += 1
    rec.in_flight += 1
    if run.config.mode == "open" and not call.rows:
        rec.lag(sent - scheduled)
    try:
        reply = await run.client.step(
            run.config.program, call.device, call.params, call.inputs, (output,),
            batch=call.batch, timeout=run.config.timeout_s,
        )  # fmt: skip
    except GraphlaneError as exc:
        if not (reraise and exc.code == "STATE_LOST"):
            rec.error(str(exc.code), time.monotonic(), device=call.device,
                      retryable=exc.retryable, message=exc.message)  # fmt: skip
        if reraise:
            raise
        return None
    except asyncio.CancelledError:
        rec.error(
            CLIENT_DEADLINE, time.monotonic(), device=call.device, retryable=True,
            message="still unanswered at the end of the run (duration + timeout)",
        )  # fmt: skip
        raise
    except Exception as exc:
        rec.error(type(exc).__name__, time.monotonic(), device=call.device,
                  retryable=False, message=str(exc))  # fmt: skip
        return None
    finally:
        rec.in_flight -= 1
    rec.ok(call, scheduled, time.monotonic())
    return reply


async def finish(run: Run, tasks: set[asyncio.Task[Any]]) -> None:
    """Wait for the tasks at most timeout_s after sending ended, and at most
    :data:`STOP_DRAIN_S` after a stop (even one that comes while waiting), then cancel
    what is left."""
    run.end_sending()
    assert run.sent_until is not None
    deadline = run.sent_until + run.config.timeout_s
    pending = set(tasks)
    stopped = asyncio.ensure_future(run.stop.wait())
    try:
        while pending:
            now = time.monotonic()
            if run.stop.is_set():
                deadline = min(deadline, now + STOP_DRAIN_S)
            if now >= deadline:
                break
            wake = pending if stopped.done() else pending | {stopped}
            done, _ = await asyncio.wait(wake, timeout=deadline - now,
                                         return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            pending -= done
    finally:
        stopped.cancel()
    for t in pending:
        t.cancel()
    for t in pending:
        with contextlib.suppress(asyncio.CancelledError):
            await t
    for t in tasks:
        error = None if t.cancelled() or not t.done() else t.exception()
        if error is not None and not isinstance(error, asyncio.CancelledError):
            raise error  # a bug of the load generator: do not hide it
