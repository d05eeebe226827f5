"""``graphlane loadtest``: drive a running daemon with attention steps and measure it.

(A program with a paged KV cache, such as ``paged_attention``, gets a scheduler's
decode workload instead: :mod:`.loadtest_paged`.)

Two load models:

* **closed loop** (``--concurrency C``): C callers, each sending its next step as
  soon as the previous one is answered. Latency is measured from the send.
* **open loop** (``--rate R``): Poisson arrivals at R steps/s, scheduled ahead
  from a seeded RNG, each launched as its own task. Latency is measured from
  the arrival's *scheduled* time, so a stalled server (or a stalled client)
  shows up as latency, not as a lower arrival rate. Outstanding calls are
  capped (``--max-outstanding``, default 10 s worth of arrivals, at least 100
  and at most 10,000); an arrival over the cap is not sent and is counted as
  the error ``CLIENT_OVERLOAD``, so memory stays bounded.

Both stop starting steps after ``--duration`` and wait at most ``--timeout``
more for the calls in flight (each call also has that deadline). A call still
unanswered at that point is cancelled and counted as ``CLIENT_DEADLINE``. From
the command line, a first Ctrl-C ends the sending early the same way (the
report is still written, marked ``interrupted``, and the summary printed; the
command then says "interrupted" and exits 130); a second one aborts (one line,
130), as does a Ctrl-C before the run started.
Nothing is retried: every error is counted by its wire code (a
:class:`~graphlane.GraphlaneError`'s ``code``; any other exception by its class
name) and the caller moves on, in the closed loop after a backoff (exponential
with jitter, capped; see :mod:`.loadtest_availability`), so that a server that
fails at once is not hammered.

What a step sends (the program must be attention-shaped: parameter
``actual_seq_lengths_kv``, inputs ``query``/``key``/``value``, output ``out``; the
load test knows what values those take, and refuses any other program, naming
what its hello describes, since it cannot know what values another's take):

* an **unverified** step sends random lengths and a query taken from a small
  pool made before the run, like a decode step whose KV cache stays on the
  device: the worker computes on whatever key/value its buffers hold;
* a **verified** step (a ``--verify`` fraction of steps) sends query, key and
  value for every batch row, so its output depends on nothing the daemon kept,
  and is compared with eager attention computed in this process (torch's
  ``scaled_dot_product_attention``, layer after layer, written independently of
  the device's kernel: ``loadtest_workload.reference``). The cases (lengths, inputs and
  their reference output) are made before the run, a few per batch size, and
  used in turn per (device, batch size), so consecutive verified steps on one
  graph differ; the client does no attention math while it measures. A
  mismatch is counted (``verify_failures``) and the run goes on.

Shapes: the daemon's ``hello`` tells each program's buckets, outputs and task
groups (= layers for attention), not its head counts or lengths. Those come
from ``--shape`` (defaults: :class:`AttentionConfig`'s), the layer count from
``hello``. Before the run one verified step is sent to each device (not
measured; it also opens the connections): a daemon whose program has other
shapes refuses it with BAD_REQUEST naming the field, and the load test stops
there with that message.

The report (:func:`run_load` returns it, :mod:`.loadtest_report` builds it and
:mod:`.report` writes it as ``report.json`` and ``report.html`` with PNG plots):
successful ``steps``, ``throughput`` (steps/s over the whole run, tail included), ``latency_ms``
(min, mean, p50, p90, p99, p99.9, max from an HDR histogram of microseconds
with 3 significant digits; its encoding is ``latency_hdr_us``), ``errors`` by
code, ``verified`` / ``verify_failures``, ``per_device`` and ``per_batch``
counts and percentiles, a ``timeseries`` (~120 windows), the open loop's
``send_lag_ms`` (how late the client sent, already part of the latency), the
resolved ``config`` and a ``verdict``.

Exit status of :func:`.loadtest_cli.main`: 0 when at least one step succeeded, no verified
output was wrong and every error was retryable (BUSY, TIMEOUT, WORKER_LOST,
SHUTTING_DOWN, or the client's own CLIENT_OVERLOAD / CLIENT_DEADLINE: what a
loaded or restarting server is expected to answer); 1 when a verification
failed, an error was not retryable (BAD_REQUEST, INTERNAL, a client
exception...), no step succeeded, or the server was unavailable for more than
``max_unavailable`` of the sending time (see :mod:`.loadtest_availability`);
2 when the flags are invalid or the run could not start (program not served or
not one the load test can drive, shapes differ); 3 when nothing answered at the
endpoint within ``--connect-timeout``; 130 after a Ctrl-C, wherever it came.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from graphlane.client import Client, StepReply
from graphlane.protocol.errors import GraphlaneError

from .loadtest_availability import DeviceBackoff
from .loadtest_config import LoadConfig
from .loadtest_record import Recorder, window_for
from .loadtest_report import CLIENT_DEADLINE, CLIENT_OVERLOAD, assess, build_report
from .loadtest_workload import Plan, Step, Workload, check_output, resolve_plan

__all__ = [
    "CLIENT_DEADLINE",
    "CLIENT_OVERLOAD",
    "LoadConfig",
    "LoadTestError",
    "assess",
    "build_report",
    "run_load",
]


class LoadTestError(RuntimeError):
    """The load test could not start against this daemon (shapes, program, ...)."""


# ---------------------------------------------------------------------------- the run
@dataclass
class Run:
    config: LoadConfig
    client: Client
    plan: Plan
    workload: Workload
    rec: Recorder
    stop_at: float
    stop: asyncio.Event
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)  # every task of the run
    sent_until: float | None = None  # when sending ended (stop_at, or earlier when stopped)

    def sending(self) -> bool:
        return self.sent_until is None and not self.stop.is_set()

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


async def _one(run: Run, step: Step, scheduled: float) -> None:
    rec = run.rec
    sent = time.monotonic()
    rec.sent += 1
    rec.in_flight += 1
    if run.config.mode == "open":
        rec.lag(sent - scheduled)
    try:
        reply: StepReply = await run.client.step(
            run.config.program,
            step.device,
            {"actual_seq_lengths_kv": step.lengths},
            step.inputs,
            ("out",),
            batch=step.batch,
            timeout=run.config.timeout_s,
        )
    except GraphlaneError as exc:
        rec.error(
            str(exc.code),
            time.monotonic(),
            device=step.device,
            retryable=exc.retryable,
            message=exc.message,
        )
        return
    except asyncio.CancelledError:
        rec.error(
            CLIENT_DEADLINE,
            time.monotonic(),
            device=step.device,
            retryable=True,
            message="still unanswered at the end of the run (duration + timeout)",
        )
        raise
    except Exception as exc:
        rec.error(
            type(exc).__name__,
            time.monotonic(),
            device=step.device,
            retryable=False,
            message=str(exc),
        )
        return
    finally:
        rec.in_flight -= 1
    done = time.monotonic()
    rec.ok(step, scheduled, done)
    if step.case is not None:
        out = reply.outputs.get("out")
        err = check_output(step.case, out, run.plan.dtype) if out is not None else None
        rec.verification(step, err)


async def _finish(run: Run, tasks: set[asyncio.Task[Any]]) -> None:
    """Wait for the tasks at most timeout_s after sending ended, then cancel what is left."""
    run.end_sending()
    assert run.sent_until is not None
    deadline = run.sent_until + run.config.timeout_s
    done: set[asyncio.Task[Any]] = set()
    if tasks:
        done, pending = await asyncio.wait(
            set(tasks), timeout=max(0.0, deadline - time.monotonic())
        )
        for t in pending:
            t.cancel()
        for t in pending:
            with contextlib.suppress(asyncio.CancelledError):
                await t
    for t in done:
        error = None if t.cancelled() else t.exception()
        if error is not None:
            raise error  # a bug of the load generator: do not hide it


async def _closed_loop(run: Run) -> None:
    assert run.config.concurrency is not None

    async def caller(i: int) -> None:
        rng = random.Random(run.config.seed * 1_000_003 + i)
        while time.monotonic() < run.stop_at and run.sending():
            now = time.monotonic()
            release = backoff.all_held(run.plan.devices, now)
            if release is not None:
                await run.pause(min(release, run.stop_at) - now)
                continue
            step = run.workload.draw(rng)
            if backoff.held(step.device, now):
                continue  # route around a device that just failed: draw again
            run.rec.arrivals += 1
            before = run.rec.errors_total
            await _one(run, step, time.monotonic())
            if run.rec.errors_total != before:
                backoff.failure(step.device, time.monotonic())
            else:
                backoff.success(step.device)

    # After an error, a device is held for a while (exponential backoff with jitter):
    # a server that fails at once must not be hammered in a busy loop.
    backoff = DeviceBackoff(random.Random(run.config.seed ^ 0xB0FF))
    tasks = {asyncio.create_task(caller(i)) for i in range(run.config.concurrency)}
    run.tasks.update(tasks)
    await run.pause(run.stop_at - time.monotonic())
    await _finish(run, tasks)


async def _open_loop(run: Run, start: float) -> None:
    assert run.config.rate is not None
    arrivals = random.Random(run.config.seed)  # the schedule does not depend on the draws
    draws = random.Random(run.config.seed * 1_000_003 + 1)
    cap = run.config.outstanding_cap()
    tasks: set[asyncio.Task[Any]] = set()
    scheduled = start
    while True:
        scheduled += arrivals.expovariate(run.config.rate)
        if scheduled >= run.stop_at:
            break
        await run.pause(scheduled - time.monotonic())
        if not run.sending():
            break
        run.rec.arrivals += 1
        step = run.workload.draw(draws)
        if len(tasks) >= cap:
            run.rec.error(
                CLIENT_OVERLOAD,
                time.monotonic(),
                device=None,
                retryable=True,
                message=f"{cap} calls already outstanding (--max-outstanding)",
            )
            continue
        task = asyncio.create_task(_one(run, step, scheduled))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        run.tasks.add(task)
        task.add_done_callback(run.tasks.discard)
    await _finish(run, tasks)


async def _preflight(
    client: Client,
    config: LoadConfig,
    plan: Plan,
    workload: Workload,
    spawned: set[asyncio.Task[Any]],
) -> dict[str, str]:
    """One verified step per device, unmeasured: checks the shapes, opens the connections."""
    gen = torch.Generator().manual_seed(config.seed + 7)
    batch = min(plan.batch_sizes)
    case = workload.make_case(batch, gen)

    async def probe(device: int) -> str:
        try:
            reply = await client.step(
                config.program,
                device,
                {"actual_seq_lengths_kv": case.lengths},
                case.inputs,
                ("out",),
                batch=batch,
                timeout=config.timeout_s,
            )
        except GraphlaneError as exc:
            if exc.code in ("BAD_REQUEST", "UNKNOWN_PROGRAM", "UNKNOWN_DEVICE"):
                hint = (
                    ""  # its shapes came from the daemon: --shape would not change them
                    if plan.shape_described
                    else ". Give the daemon's program shape with --shape (e.g. --shape "
                    "num_heads=8,num_kv_heads=2,head_dim=64,max_kv_len=256)."
                )
                raise LoadTestError(
                    f"device {device} refused a step of {config.program!r} built with the shape "
                    f"{plan.shape_dict()}: {exc}{hint}"
                ) from None
            return str(exc.code)  # retryable or internal: the run will measure it
        out = reply.outputs.get("out")
        if out is None or tuple(out.shape) != tuple(case.expected.shape):
            got = None if out is None else list(out.shape)
            raise LoadTestError(
                f"device {device} answered 'out' of shape {got}, expected "
                f"{list(case.expected.shape)} from the shape {plan.shape_dict()}"
            )
        return "ok" if check_output(case, out, plan.dtype) is not None else "wrong output"

    # Every probe ends (each within timeout_s) before a failure is raised: no call may be
    # left in flight when the client closes.
    tasks = [asyncio.create_task(probe(d)) for d in plan.devices]
    spawned.update(tasks)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return {str(d): str(r) for d, r in zip(plan.devices, results, strict=True)}


async def run_load(config: LoadConfig, *, stop: asyncio.Event | None = None) -> dict[str, Any]:
    """Run the load test; returns the report (also written to ``config.report_dir`` if set).

    Bounded: after the setup (hello and one probe step per device, each with
    ``timeout_s``), it sends for ``duration_s`` (or until ``stop`` is set) and
    then waits at most ``timeout_s`` for the calls in flight.
    """
    from .loadtest_cli import Progress

    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    client = Client(
        config.endpoint,
        timeout=config.timeout_s,
        name="graphlane-loadtest",
        server_key=config.server_key,
        client_key=config.client_key,
    )
    # Every task that calls the client; all are ended before it closes (a call still in
    # flight while the client closes could open a socket that then blocks its shutdown).
    spawned: set[asyncio.Task[Any]] = set()
    progress: Progress | None = None
    try:
        hello = await client.connect()
        plan = resolve_plan(config, hello)
        workload = Workload(plan, config.seed, config.verify)
        preflight = await _preflight(client, config, plan, workload, spawned)
        progress = Progress() if config.progress else None
        start = time.monotonic()
        rec = Recorder(start, window_for(config.duration_s), config.seed)
        run = Run(
            config,
            client,
            plan,
            workload,
            rec,
            stop_at=start + config.duration_s,
            stop=stop or asyncio.Event(),
            tasks=spawned,
        )
        if progress is not None:
            spawned.add(asyncio.create_task(progress.tick(run)))
        if config.mode == "closed":
            await _closed_loop(run)
        else:
            await _open_loop(run, start)
        end = time.monotonic()
    finally:
        for t in spawned:
            t.cancel()
        await asyncio.gather(*spawned, return_exceptions=True)
        if progress is not None:
            progress.close()
        await client.close()
    report = build_report(
        config, plan, rec, hello, preflight, started_at, start, end,
        sent_until=run.sent_until, interrupted=run.stop.is_set(),
    )  # fmt: skip
    if config.report_dir:
        from .report import write_report

        json_path, html_path = write_report(report, config.report_dir)
        report["files"] = {"json": str(json_path), "html": str(html_path)}
    return report
