"""Pipelining measured through a real daemon on the timed sim, side by side.

For each cost profile (per-layer host update time ``patch_us`` and device
replay time ``task_us``) ``graphlane serve`` runs in a child process at its
default config (``depth``, ``pipeline = true``, ...) with the timed sim and a
4-layer ``attention`` program, and a client on its socket measures:

- pipelined steps/s: a window of :data:`WINDOW` steps in flight, lengths
  changing every step (every layer is patched every step);
- serial steps/s: the same through a daemon with ``pipeline = false`` (update,
  replay, wait before the next step: what a host barrier gives);
- single-step latency: one step at a time, at the client (round trip) and as the
  worker held it (``server_us``); beside each step, after as long a pause as the
  step took, a raw pyzmq+msgpack round trip to an echo process: what the transport
  alone costs a caller that was idle that long (on this machine's VM a round trip
  after 8 ms idle takes 0.6 ms, three times one made back to back).

And the zero-cost rate (:func:`zero_cost`): the same 4-layer program on the timed
sim with no modelled cost, a window of 8 steps, what the worker itself (graphlane
plus the simulator's Python) can turn over.

Reported as ratios to the physical limits:

- throughput limit: 1 / (layers * max(patch_us, task_us))
- latency floor:    layers * max(patch_us, task_us) + min(patch_us, task_us)
  (and the floor plus the raw round trip measured beside each step)

Each rate is the median of ``reps`` runs, pipelined and serial daemons up at
the same time and measured in alternation (a slow spell of the machine falls
on both alike); the latency is the median of single steps.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from graphlane.client import Client

from .control_plane import RawClient, with_raw_server
from .daemon import BenchDaemon

PROFILES: dict[str, tuple[float, float]] = {
    # name: (patch_us, task_us); the 910B3 field figures are ~185 us per layer of
    # update against ~60 us of replay (DESIGN.md), scaled here so that the sim's
    # own Python overhead stays inside the modelled costs.
    "update-bound": (1800.0, 600.0),
    "balanced": (1500.0, 1500.0),
    "replay-bound": (600.0, 1800.0),
    "balanced-0.6": (600.0, 600.0),  # the cheap end: the sim's own cost shows most here
}
LAYERS = 4
WINDOW = 8  # steps in flight in the throughput runs
BATCH = 4
PROGRAM = {"layers": LAYERS, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
           "max_kv_len": 64, "buckets": [BATCH]}  # fmt: skip


@dataclass
class PipelineFigures:
    profile: str
    patch_us: float
    task_us: float
    layers: int
    depth: int | None  # None: serve's default
    limit_steps_s: float
    serial_steps_s: float
    pipelined_steps_s: float
    floor_ms: float
    latency_ms: float  # at the client: the round trip of one step alone
    worker_latency_ms: float  # the same steps as the worker held them
    raw_rtt_ms: float = 0.0  # a raw pyzmq round trip after as long a pause, beside them

    @property
    def pipelined_vs_limit(self) -> float:
        return self.pipelined_steps_s / self.limit_steps_s

    @property
    def pipelined_vs_serial(self) -> float:
        return self.pipelined_steps_s / self.serial_steps_s if self.serial_steps_s else 0.0

    @property
    def latency_vs_floor(self) -> float:
        return self.latency_ms / self.floor_ms

    @property
    def latency_vs_floor_and_transport(self) -> float:
        """The latency over the floor plus the raw transport's round trip."""
        return self.latency_ms / (self.floor_ms + self.raw_rtt_ms)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            pipelined_vs_limit=round(self.pipelined_vs_limit, 3),
            pipelined_vs_serial=round(self.pipelined_vs_serial, 3),
            latency_vs_floor=round(self.latency_vs_floor, 3),
            latency_vs_floor_and_transport=round(self.latency_vs_floor_and_transport, 3),
        )
        return d


def _params(i: int) -> dict[str, Any]:
    # Lengths change every step, so every layer is patched every step.
    return {"actual_seq_lengths_kv": [1 + (i % PROGRAM["max_kv_len"])] * BATCH}  # type: ignore[operator]


async def _rate(c: Client, n: int) -> float:
    """n steps with WINDOW in flight: WINDOW callers, each calling again on its reply."""
    left = n

    async def caller() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await c.step("attention", 0, _params(left))

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(WINDOW)))
    return n / (time.perf_counter() - t0)


async def _latencies(
    c: Client, n: int, raw: RawClient | None = None
) -> tuple[list[float], list[float], list[float]]:
    """Round trips of n steps sent one at a time, the worker's time for each, and (with
    ``raw``) after each a pause as long as the step took, then a raw round trip."""
    rtt, held, raw_rtt = [], [], []
    for i in range(n):
        t0 = time.perf_counter()
        r = await c.step("attention", 0, _params(i))
        took = time.perf_counter() - t0
        rtt.append(took)
        held.append(r.server_us * 1e-6)
        if raw is not None:
            await asyncio.sleep(took)
            t0 = time.perf_counter()
            await raw.call()
            raw_rtt.append(time.perf_counter() - t0)
            await asyncio.sleep(took)  # the next step starts after as long a pause
    return rtt, held, raw_rtt


def _daemon(patch_us: float, task_us: float, **settings: Any) -> BenchDaemon:
    sim = {"mode": "timed", "patch_us": patch_us, "task_us": task_us}
    return BenchDaemon(PROGRAM, sim=sim, settings=settings)


async def _measure(
    pipelined: BenchDaemon, serial: BenchDaemon | None, steps: int, reps: int, raw_endpoint: str
) -> dict[str, Any]:
    raw = RawClient(raw_endpoint)
    async with Client(pipelined.endpoint, timeout=120) as p:
        s_client = Client(serial.endpoint, timeout=120) if serial else None
        try:
            if s_client is not None:
                await s_client.__aenter__()
                await _rate(s_client, 2 * WINDOW)  # warm up
            await _rate(p, 2 * WINDOW)
            rates: dict[str, list[float]] = {"pipelined": [], "serial": []}
            for _ in range(reps):
                rates["pipelined"].append(await _rate(p, steps))
                if s_client is not None:
                    rates["serial"].append(await _rate(s_client, steps))
            rtt, held, raw_rtt = await _latencies(p, max(10, steps // 2), raw)
        finally:
            if s_client is not None:
                await s_client.__aexit__(None, None, None)
            await raw.stop()
    return {
        "pipelined": statistics.median(rates["pipelined"]),
        "serial": statistics.median(rates["serial"]) if rates["serial"] else 0.0,
        "latency_ms": 1000 * statistics.median(rtt),
        "worker_latency_ms": 1000 * statistics.median(held),
        "raw_rtt_ms": 1000 * statistics.median(raw_rtt),
    }


def measure(
    profile: str,
    patch_us: float,
    task_us: float,
    steps: int = 60,
    reps: int = 3,
    depth: int | None = None,
    serial: bool = True,
) -> PipelineFigures:
    """One profile through a daemon at the default config (or ``depth``), and, with
    ``serial``, through a serial daemon beside it."""
    settings = {} if depth is None else {"depth": depth}
    daemons = [_daemon(patch_us, task_us, **settings)]
    try:
        if serial:
            daemons.append(_daemon(patch_us, task_us, pipeline=False))
        f = with_raw_server(
            lambda raw: _measure(daemons[0], daemons[1] if serial else None, steps, reps, raw)
        )
    finally:
        for d in daemons:
            d.close()
    worst, best = max(patch_us, task_us), min(patch_us, task_us)
    return PipelineFigures(
        profile=profile,
        patch_us=patch_us,
        task_us=task_us,
        layers=LAYERS,
        depth=depth,
        limit_steps_s=1e6 / (LAYERS * worst),
        serial_steps_s=f["serial"],
        pipelined_steps_s=f["pipelined"],
        floor_ms=(LAYERS * worst + best) / 1000,
        latency_ms=f["latency_ms"],
        worker_latency_ms=f["worker_latency_ms"],
        raw_rtt_ms=f["raw_rtt_ms"],
    )


#: The zero-cost rate's goal (issue 20): the simulator is not the bottleneck.
ZERO_COST_GOAL_STEPS_S = 2000.0


def zero_cost(steps: int = 2000, reps: int = 3) -> dict[str, Any]:
    """Steps/s of the 4-layer program through a daemon at serve's default config on
    the timed sim with zero modelled cost (a window of WINDOW steps; every layer
    patched every step), the median of ``reps`` runs, and one step's latency alone."""

    async def go(endpoint: str) -> dict[str, Any]:
        async with Client(endpoint, timeout=120) as c:
            await _rate(c, 4 * WINDOW)  # warm up
            rates = [await _rate(c, steps) for _ in range(reps)]
            rtt, held, _ = await _latencies(c, 100)
        return {
            "steps_s": statistics.median(rates),
            "runs_steps_s": rates,
            "latency_ms": 1000 * statistics.median(rtt),
            "worker_latency_ms": 1000 * statistics.median(held),
            "layers": LAYERS,
            "window": WINDOW,
            "goal_steps_s": ZERO_COST_GOAL_STEPS_S,
        }

    d = _daemon(0.0, 0.0)
    try:
        return asyncio.run(go(d.endpoint))
    finally:
        d.close()


def run(
    steps: int = 60, profiles: dict[str, tuple[float, float]] | None = None
) -> list[PipelineFigures]:
    """Every profile at serve's default config, beside the serial mode."""
    return [measure(name, p, t, steps) for name, (p, t) in (profiles or PROFILES).items()]


def depths(
    profile: str = "balanced", choices: tuple[int, ...] = (1, 2, 3), steps: int = 60
) -> list[PipelineFigures]:
    """One profile at each ``depth`` (no serial run): how the default was chosen."""
    p, t = PROFILES[profile]
    return [measure(profile, p, t, steps, depth=d, serial=False) for d in choices]


def format_zero_cost(z: dict[str, Any]) -> str:
    runs = ", ".join(f"{r:.0f}" for r in z["runs_steps_s"])
    return (
        f"zero cost ({z['layers']} layers, timed sim at 0 us, {z['window']} in flight): "
        f"{z['steps_s']:.0f} steps/s (runs: {runs}; goal >= {z['goal_steps_s']:.0f}); "
        f"one step alone {z['latency_ms']:.2f} ms (worker {z['worker_latency_ms']:.2f} ms)"
    )


def table(results: list[PipelineFigures]) -> str:
    head = (
        f"{'profile':<13} {'depth':>5} {'patch/task us':>13} {'limit/s':>8} {'serial/s':>9} "
        f"{'pipelined/s':>11} {'vs limit':>8} {'vs serial':>9} {'latency ms':>10} "
        f"{'(worker)':>8} {'floor ms':>8} {'vs floor':>8} {'raw rtt ms':>10} "
        f"{'vs floor+raw':>12}"
    )
    lines = [head]
    for r in results:
        serial = f"{r.serial_steps_s:9.1f}" if r.serial_steps_s else f"{'-':>9}"
        vs_serial = f"{r.pipelined_vs_serial:8.2f}x" if r.serial_steps_s else f"{'-':>9}"
        lines.append(
            f"{r.profile:<13} {r.depth or 'dflt':>5} {f'{r.patch_us:g}/{r.task_us:g}':>13} "
            f"{r.limit_steps_s:8.1f} {serial} {r.pipelined_steps_s:11.1f} "
            f"{r.pipelined_vs_limit:8.2f} {vs_serial} {r.latency_ms:10.2f} "
            f"{r.worker_latency_ms:8.2f} {r.floor_ms:8.2f} {r.latency_vs_floor:7.2f}x "
            f"{r.raw_rtt_ms:10.2f} {r.latency_vs_floor_and_transport:11.2f}x"
        )
    return "\n".join(lines)


__all__ = [
    "PROFILES",
    "ZERO_COST_GOAL_STEPS_S",
    "PipelineFigures",
    "depths",
    "format_zero_cost",
    "measure",
    "run",
    "table",
    "zero_cost",
]
