"""The load test's one arrival engine (graphlane.loadtest.run.arrive), which independent
calls, paged sequences and a model's requests all share: a closed loop keeps exactly C
in flight, an open loop caps what is outstanding, ``inf`` with a limit starts them all
at once, and a stop ends arrivals at once."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from graphlane.loadtest import LoadConfig
from graphlane.loadtest.record import Recorder
from graphlane.loadtest.run import CLIENT_OVERLOAD, Run, arrive, finish


def _run(duration_s: float = 0.3, **kw: Any) -> Run:
    config = LoadConfig("ipc:///nowhere", duration_s, progress=False, **kw)
    start = time.monotonic()
    rec = Recorder(start, 0.25, 0)
    return Run(config, None, rec, stop_at=start + duration_s,  # type: ignore[arg-type]
               stop=asyncio.Event())  # fmt: skip


async def test_a_closed_loop_keeps_c_in_flight_the_next_when_one_ends() -> None:
    run, live, most = _run(concurrency=3), 0, 0

    async def one(_: float) -> None:
        nonlocal live, most
        live += 1
        most = max(most, live)
        await asyncio.sleep(0.01)
        live -= 1

    await finish(run, await arrive(run, one))
    assert most == 3 and run.rec.arrivals > 3  # C at a time, then more as they ended


async def test_an_open_loop_caps_the_outstanding_and_inf_starts_all_at_once() -> None:
    run = _run(rate=200.0)
    never = asyncio.Event()
    tasks = await arrive(run, lambda _: never.wait(), cap=2)
    assert len(tasks) == 2 and run.rec.errors[CLIENT_OVERLOAD] == run.rec.arrivals - 2 > 0
    run.stop.set()
    await finish(run, tasks)
    assert all(t.cancelled() for t in tasks)

    run = _run(duration_s=60.0, rate=math.inf, num_prompts=5)
    started: list[float] = []

    def one(t: float) -> Any:
        started.append(t)
        return asyncio.sleep(0)

    tasks = await arrive(run, one, limit=5)
    # one() is called at each arrival (a request is queued before arrive returns), all
    # five at the same arrival time
    assert run.rec.arrivals == len(started) == 5 and len(set(started)) == 1
    await finish(run, tasks)


async def test_a_stop_ends_the_arrivals_at_once() -> None:
    run = _run(duration_s=60.0, concurrency=2)
    asyncio.get_running_loop().call_later(0.05, run.stop.set)
    t0 = time.monotonic()
    await finish(run, await arrive(run, lambda _: asyncio.sleep(30)))
    assert time.monotonic() - t0 < 30 and run.rec.arrivals == 2 and run.sent_until is not None
