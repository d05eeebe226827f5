"""Through a real daemon, the timed sim never runs a step below its floor (issue 32, item 6).

tests/workers/test_timed_floors.py holds the in-process loop and the step engine to their
floors in modelled time. Here the path users run is measured: ``graphlane serve`` on the
timed sim at its default config (pipelined) and serial, a client sending the 4-layer
attention program's steps, one at a time (a scheduler waiting for each step) and with a
window in flight. What is asserted is wall time, which the machine's load only makes
longer: the time the worker held each lone step (its reply's ``server_us``: the request
decoded to the reply sent, the device work in it) and the wall time of a window of steps.
A cost model that let a patch start before the request that asked for it arrived (the
slack of the previous patch chained across the reply and the next request: a lone step
held 0.58 ms against a 0.80 ms floor) fails here.

Floors for L layers of per-layer update u (host) and replay c (device):
a lone step, pipelined     L * max(u, c) + min(u, c)
a lone step, serial        L * u + L * c
steps in flight            L * max(u, c) per step, less one lone step for the first fill
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from graphlane.bench.inprocess import BATCH, LAYERS, PROGRAM
from graphlane.client import Client

COSTS = [(185.0, 60.0), (60.0, 185.0)]  # (u, c) per layer: the field's, and replay-bound
STEPS = 12
WINDOW, WINDOWED = 4, 16


def _lengths(i: int) -> list[int]:
    return [1 + i % 8] * BATCH  # changing lengths: every step patches every layer


def _lone_floor(u: float, c: float, pipeline: bool) -> float:
    if pipeline:
        return (LAYERS * max(u, c) + min(u, c)) * 1e-6
    return LAYERS * (u + c) * 1e-6


async def _lone_steps(c: Client) -> list[float]:
    held = []
    for i in range(STEPS):
        reply = await c.step("attention", 0, {"actual_seq_lengths_kv": _lengths(i)},
                             outputs=["out"])  # fmt: skip
        held.append(reply.server_us * 1e-6)
    return held


async def _windowed(c: Client) -> float:
    sem = asyncio.Semaphore(WINDOW)

    async def one(i: int) -> Any:
        async with sem:
            return await c.step("attention", 0, {"actual_seq_lengths_kv": _lengths(i)},
                                outputs=["out"])  # fmt: skip

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(WINDOWED)))
    return time.perf_counter() - t0


@pytest.mark.parametrize(("u", "c"), COSTS)
@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "serial"])
def test_steps_through_a_daemon_never_beat_their_floor(
    start_daemon: Callable[..., Any], pipeline: bool, u: float, c: float
) -> None:
    d = start_daemon(
        devices=1,
        pipeline=pipeline,
        sim={"mode": "timed", "patch_us": u, "task_us": c},
        programs=[{"name": "attention", **PROGRAM}],
    )

    async def run() -> tuple[list[float], float]:
        async with Client(d.endpoint, timeout=60) as client:
            await client.step("attention", 0, {"actual_seq_lengths_kv": _lengths(0)},
                              outputs=["out"])  # fmt: skip  # connected, warmed up
            return await _lone_steps(client), await _windowed(client)

    held, window_s = asyncio.run(run())
    floor = _lone_floor(u, c, pipeline)
    assert min(held) >= floor, (held, floor)
    per_step = LAYERS * max(u, c) * 1e-6 if pipeline else floor
    assert window_s >= WINDOWED * per_step - _lone_floor(u, c, pipeline), (window_s, per_step)
