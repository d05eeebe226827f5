"""One run of the load test as every driver shares it: the client, the recorder and when
sending ends (:class:`Run`); :func:`arrive`, the one arrival engine of calls, sequences
and requests; :func:`send`, the one place a step is sent, timed and counted;
:func:`finish`, the bounded wait for what is in flight."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from graphlane.protocol.errors import GraphlaneError

from .config import LoadConfig
from .record import Call, Recorder

if TYPE_CHECKING:
    from graphlane.client import Client, StepReply

#: Error codes of the load generator itself (never on the wire).
CLIENT_OVERLOAD = "CLIENT_OVERLOAD"
CLIENT_DEADLINE = "CLIENT_DEADLINE"
#: After a stop (Ctrl-C), the most the calls in flight get before they are abandoned
#: (cancelled, counted as CLIENT_DEADLINE), whatever ``timeout_s`` says.
STOP_DRAIN_S = 0.5
#: Tolerances (atol = rtol) of a checked output, by its dtype.
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 6e-2, torch.float32: 1e-4}


class LoadTestError(RuntimeError):
    """The load test cannot run against this daemon (program, shapes, devices ...)."""


def close_to(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> float | None:
    """The max |out - expected|, or None when ``out`` is wrong (shape or tolerance)."""
    if tuple(out.shape) != tuple(expected.shape):
        return None
    tol = TOLERANCE.get(dtype, 1e-2)
    got, want = out.float(), expected.float()
    err = float((got - want).abs().max()) if got.numel() else 0.0
    if not torch.allclose(got, want, rtol=tol, atol=tol) or not math.isfinite(err):
        return None
    return err


@dataclass
class Run:
    config: LoadConfig
    client: Client
    rec: Recorder
    stop_at: float
    stop: asyncio.Event
    tasks: set[asyncio.Future[Any]] = field(default_factory=set)  # every task of the run
    sent_until: float | None = None  # when sending ended (stop_at, or earlier when stopped)
    verify: float = 0.0  # the share of steps checked
    extra: dict[str, Any] = field(default_factory=dict)  # the workload's own figures
    loops: list[Any] = field(default_factory=list)  # its devices' loops (to watch a run)

    def sending(self) -> bool:
        return self.sent_until is None and not self.stop.is_set()

    def phase(self) -> str:
        return "sending" if self.sent_until is None else "waiting for calls in flight"

    async def pause(self, seconds: float) -> None:
        """Sleep, waking up early if the run is stopped."""
        await self.until(asyncio.sleep(max(0.0, seconds)), seconds)

    async def until(self, awaitable: Awaitable[Any], limit: float | None = None) -> bool:
        """Await ``awaitable`` until the duration is over (or ``limit`` seconds passed)
        or the run is stopped; whether it completed (if not, it is cancelled)."""
        wait = max(0.0, self.stop_at - time.monotonic() if limit is None else limit)
        waited = asyncio.ensure_future(awaitable)
        stopped = asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait([waited, stopped], timeout=wait, return_when="FIRST_COMPLETED")
        finally:
            stopped.cancel()
            if not waited.done():
                waited.cancel()
            await asyncio.gather(waited, stopped, return_exceptions=True)
        return waited.done() and not waited.cancelled()

    def end_sending(self) -> None:
        if self.sent_until is None:
            now = time.monotonic()
            self.sent_until = now if self.stop.is_set() else min(now, self.stop_at)

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Future[Any]:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task


async def arrive(
    run: Run, one: Callable[[float], Awaitable[Any]], *, cap: int | None = None,
    limit: int | None = None,
) -> set[asyncio.Future[Any]]:  # fmt: skip
    """Call ``one(arrival time)`` per arrival until sending ends (or ``limit`` arrived) and
    run what it returns: closed loop, ``concurrency`` at a time, the next when one ends;
    open loop, Poisson arrivals at ``rate`` (inf: all at once), at most ``cap``
    outstanding (an arrival over it is counted as CLIENT_OVERLOAD). Returns the tasks
    still running."""
    cfg, rec = run.config, run.rec
    rng = random.Random(cfg.seed)  # the schedule does not depend on the draws
    slots = asyncio.Semaphore(cfg.concurrency or 1)
    tasks: set[asyncio.Future[Any]] = set()
    t = time.monotonic()
    while run.sending() and (limit is None or rec.arrivals < limit):
        if cfg.mode == "closed":
            if not await run.until(slots.acquire()):
                break
            t = time.monotonic()
        elif cfg.rate is not None and math.isfinite(cfg.rate):
            t += rng.expovariate(cfg.rate)
            await run.pause(min(t, run.stop_at) - time.monotonic())
        if not run.sending() or time.monotonic() >= run.stop_at:
            break
        rec.arrivals += 1
        if cap is not None and len(tasks) >= cap:
            rec.error(CLIENT_OVERLOAD, time.monotonic(), device=None, retryable=True,
                      message=f"{cap} calls already outstanding (--max-outstanding)")  # fmt: skip
            continue
        task = run.spawn(one(t))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        if cfg.mode == "closed":
            task.add_done_callback(lambda _: slots.release())
    return tasks


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
    except asyncio.CancelledError:
        deadline(rec, call.device)
        raise
    except Exception as exc:
        lost = isinstance(exc, GraphlaneError) and exc.code == "STATE_LOST"
        if not (reraise and lost):
            rec.failed(exc, call.device)
        if reraise and isinstance(exc, GraphlaneError):
            raise
        return None
    finally:
        rec.in_flight -= 1
    rec.ok(call, scheduled, time.monotonic())
    return reply


def deadline(rec: Recorder, device: int) -> None:
    """A call abandoned at the end of the run."""
    rec.error(CLIENT_DEADLINE, time.monotonic(), device=device, retryable=True,
              message="still unanswered at the end of the run (duration + timeout)")  # fmt: skip


async def finish(run: Run, tasks: set[asyncio.Future[Any]]) -> None:
    """Wait for the tasks at most timeout_s after sending ended, and at most
    :data:`STOP_DRAIN_S` after a stop (even one that comes while waiting), then cancel
    what is left; a task's exception (a bug of the load test) is raised."""
    run.end_sending()
    assert run.sent_until is not None
    deadline_ = run.sent_until + run.config.timeout_s
    tasks = set(tasks)
    if tasks:
        await run.until(asyncio.wait(tasks), deadline_ - time.monotonic())
    pending = {t for t in tasks if not t.done()}
    left = min(deadline_ - time.monotonic(), STOP_DRAIN_S)
    if pending and run.stop.is_set() and left > 0:
        await asyncio.wait(pending, timeout=left)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for t in tasks:
        if not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]


def batch_figures(loops: list[Any], tokens: int, arrived: int, finished: int,
                  cut: int) -> dict[str, Any]:  # fmt: skip
    """The report's figures of continuously batched device loops (the reference
    scheduler's, :mod:`.paged`'s): both count steps, batches and sequences alike."""
    steps, batch, bucket = (sum(getattr(lp, k) for lp in loops)
                            for k in ("steps", "batch_sum", "bucket_sum"))  # fmt: skip
    return {
        "tokens": tokens,
        "mean_batch": round(batch / steps, 3) if steps else 0.0,
        "occupancy": round(batch / bucket, 3) if bucket else 0.0,
        "sequences": {"arrived": arrived, "admitted": sum(len(lp.admitted) for lp in loops),
                      "finished": finished, "reprefilled": sum(lp.reprefilled for lp in loops),
                      "cut": cut, "never_admitted": sum(len(lp.queue) for lp in loops)},
        "state_lost": sum(lp.state_losses for lp in loops),
    }
