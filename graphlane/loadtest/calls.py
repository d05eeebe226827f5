"""Independent calls: how the load test drives a program without device state.

* **closed loop** (``--concurrency C``): C callers, each sending its next call as soon
  as the previous one is answered. Latency is measured from the send. After an error
  on a device, the callers hold that device back (see :mod:`.availability`).
* **open loop** (``--rate R``): Poisson arrivals at R calls/s, scheduled ahead from a
  seeded RNG, each launched as its own task. Latency is measured from the arrival's
  *scheduled* time, so a stalled server (or a stalled client) shows up as latency, not
  as a lower arrival rate. Outstanding calls are capped (``--max-outstanding``); an
  arrival over the cap is not sent and is counted as the error ``CLIENT_OVERLOAD``.

Before the run, one checked call per device (:func:`preflight`, not measured) checks
the shapes and opens the connections.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from graphlane.client import Client
from graphlane.protocol.errors import GraphlaneError

from .availability import DeviceBackoff
from .config import LoadConfig
from .run import CLIENT_OVERLOAD, Run, finish, send
from .workload import Call, CallWorkload, LoadTestError


async def _one(run: Run, workload: CallWorkload, call: Call, scheduled: float) -> None:
    reply = await send(run, call, workload.output, scheduled)
    if reply is not None and call.expected is not None:
        out = reply.outputs.get(workload.output)
        error = workload.check(call, out) if out is not None else None
        run.rec.verification(call, error, reply.generation)


async def drive_calls(run: Run, workload: CallWorkload, start: float) -> None:
    """Send independent calls until the run's end, closed or open loop."""
    if run.config.mode == "closed":
        await _closed_loop(run, workload)
    else:
        await _open_loop(run, workload, start)


async def _closed_loop(run: Run, workload: CallWorkload) -> None:
    assert run.config.concurrency is not None

    async def caller(i: int) -> None:
        rng = random.Random(run.config.seed * 1_000_003 + i)
        while time.monotonic() < run.stop_at and run.sending():
            now = time.monotonic()
            release = backoff.all_held(workload.devices, now)
            if release is not None:
                await run.pause(min(release, run.stop_at) - now)
                continue
            call = workload.draw(rng)
            if backoff.held(call.device, now):
                continue  # route around a device that just failed: draw again
            run.rec.arrivals += 1
            before = run.rec.errors_total
            await _one(run, workload, call, time.monotonic())
            if run.rec.errors_total != before:
                backoff.failure(call.device, time.monotonic())
            else:
                backoff.success(call.device)

    # After an error, a device is held for a while (exponential backoff with jitter):
    # a server that fails at once must not be hammered in a busy loop.
    backoff = DeviceBackoff(random.Random(run.config.seed ^ 0xB0FF))
    tasks = {asyncio.create_task(caller(i)) for i in range(run.config.concurrency)}
    run.tasks.update(tasks)
    await run.pause(run.stop_at - time.monotonic())
    await finish(run, tasks)


async def _open_loop(run: Run, workload: CallWorkload, start: float) -> None:
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
        call = workload.draw(draws)
        if len(tasks) >= cap:
            run.rec.error(
                CLIENT_OVERLOAD,
                time.monotonic(),
                device=None,
                retryable=True,
                message=f"{cap} calls already outstanding (--max-outstanding)",
            )
            continue
        task = asyncio.create_task(_one(run, workload, call, scheduled))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        run.tasks.add(task)
        task.add_done_callback(run.tasks.discard)
    await finish(run, tasks)


async def preflight(
    client: Client,
    config: LoadConfig,
    workload: CallWorkload,
    spawned: set[asyncio.Task[Any]],
) -> dict[str, str]:
    """One checked call per device, unmeasured: checks the shapes, opens the connections."""
    described = workload.describe()
    shape = described["shape"]

    async def probe(device: int) -> str:
        call = workload.probe(device)
        assert call.expected is not None
        try:
            reply = await client.step(
                config.program, device, call.params, call.inputs, (workload.output,),
                batch=call.batch, timeout=config.timeout_s,
            )  # fmt: skip
        except GraphlaneError as exc:
            if exc.code in ("BAD_REQUEST", "UNKNOWN_PROGRAM", "UNKNOWN_DEVICE"):
                hint = (
                    ""  # its shapes came from the daemon: --shape would not change them
                    if described.get("shape_from") != "--shape"
                    else ". Give the daemon's program shape with --shape (e.g. --shape "
                    "num_heads=8,num_kv_heads=2,head_dim=64,max_kv_len=256)."
                )
                raise LoadTestError(
                    f"device {device} refused a step of {config.program!r} built with the shape "
                    f"{shape}: {exc}{hint}"
                ) from None
            return str(exc.code)  # retryable or internal: the run will measure it
        out = reply.outputs.get(workload.output)
        if out is None or tuple(out.shape) != tuple(call.expected.shape):
            got = None if out is None else list(out.shape)
            raise LoadTestError(
                f"device {device} answered {workload.output!r} of shape {got}, expected "
                f"{list(call.expected.shape)} from the shape {shape}"
            )
        return "ok" if workload.check(call, out) is not None else "wrong output"

    # Every probe ends (each within timeout_s) before a failure is raised: no call may be
    # left in flight when the client closes.
    tasks = [asyncio.create_task(probe(d)) for d in workload.devices]
    spawned.update(tasks)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return {str(d): str(r) for d, r in zip(workload.devices, results, strict=True)}


