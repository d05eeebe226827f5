"""The field's way, in one process, beside the same steps through a daemon.

vllm-ascend runs a full-graph decode step in the process that schedules it: the
replay is launched, then each layer's update is dispatched on the update stream
and releases that layer's ExternalEvent (the graph waits per layer on it), and
the host waits for the step's output. :class:`InProcessLoop` is that loop over
the 4-layer ``attention`` program on the timed sim, with the same modelled costs
as a daemon's worker (per-layer host update ``patch_us``, device replay
``task_us``), the same program, buffers and fused update binding, and no
graphlane engine, socket or client in between.

:func:`measure` runs it and a daemon (``graphlane serve`` at its default config, a
child process) side by side in one run, in alternation, and reports:

- lone-step latency: one step at a time, the host (or client) waiting for its
  output before it sends the next, timed from one output to the next (the loop's
  period: in process the timed model hides the host's own Python before a step's
  first update inside that update, so issue-to-output would flatter it); daemon
  over in-process;
- windowed throughput: :data:`WINDOW` steps in flight (in process: a ring of
  ``depth`` graph instances, each step's updates fenced after the previous
  replay of its instance, the host waiting for step N-WINDOW+1's output before
  it issues step N+1); daemon over in-process.

The in-process loop also reports its *modelled* times (the sim's device-time
events: what the timed model says the schedule took, without the machine's
load), which never go below the floors (tests/sim/test_timed_floors.py):

- lone step:  layers * max(patch_us, task_us) + min(patch_us, task_us)
- windowed:   layers * max(patch_us, task_us) per step
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from npusim import configure

from graphlane.client import Client
from graphlane.workers.backends.sim import SimBackend
from graphlane.workers.programs.attention import AttentionConfig, AttentionProgram
from graphlane.workers.programs.base import StepPlan

from .daemon import BenchDaemon

PROFILES: dict[str, tuple[float, float]] = {
    # name: (patch_us, task_us) per layer
    "field": (185.0, 60.0),  # vllm-ascend on a 910B3 (issue 32)
    "field-x4": (740.0, 240.0),
    "balanced": (1500.0, 1500.0),
}
LAYERS = 4
WINDOW = 8
BATCH = 4
PROGRAM = {"layers": LAYERS, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
           "max_kv_len": 64, "buckets": [BATCH]}  # fmt: skip


def _lengths(i: int) -> list[int]:
    # Lengths change every step, so every layer is patched every step (as bench_pipeline).
    return [1 + (i % PROGRAM["max_kv_len"])] * BATCH  # type: ignore[operator]


class InProcessLoop:
    """The attention program captured ``depth`` times on the timed sim of this process,
    driven as vllm-ascend drives its full-graph decode (see the module doc).

    Configures the process's sim (timed, ``patch_us``/``task_us``); one loop per
    process at a time."""

    def __init__(self, patch_us: float, task_us: float, depth: int = 2) -> None:
        cfg = {k: v for k, v in PROGRAM.items() if k != "buckets"}
        self.program = AttentionProgram(AttentionConfig(buckets=(BATCH,), **cfg))  # type: ignore[arg-type]
        configure(mode="compute")  # capture computes nothing either way; allocate zeroes
        b = self.backend = SimBackend()
        self.S, self.U = b.new_stream(), b.new_stream(priority=-1)
        self.instances: list[dict[str, Any]] = []
        for _ in range(depth):
            bufs = self.program.allocate(b, BATCH)
            events = [b.new_external_event() for _ in range(LAYERS)]
            graph = b.new_graph()
            b.synchronize()
            with b.capture(graph, self.S):
                handles, _ = self.program.capture(b, self.S, BATCH, bufs, events)
            self.instances.append(
                {"graph": graph, "bufs": bufs, "events": events, "handles": handles, "done": None}
            )
        b.synchronize()
        configure(mode="timed", patch_us=patch_us, task_us=task_us)
        self.n = 0

    def issue(self, lengths: list[int]) -> tuple[torch.Tensor, Any]:
        """Issue one step: replay, then each layer's update releasing its event; returns
        the output's host copy and the step's done event (timed: modelled device time)."""
        b, S, U = self.backend, self.S, self.U
        g = self.instances[self.n % len(self.instances)]
        self.n += 1
        previous = g["done"]
        plan = StepPlan("attention", BATCH, BATCH, {"lengths": tuple(lengths)})
        b.replay(g["graph"], S)
        with b.use_stream(S):
            out = g["bufs"][f"out_{LAYERS - 1}"].to("cpu", non_blocking=True)
            done = g["done"] = torch.npu.Event(enable_timing=True)  # type: ignore[attr-defined]
            done.record(S)
        if previous is not None:  # the previous replay of this instance read its groups
            U.wait_event(previous)
        for layer in range(LAYERS):
            op, args, kwargs = self.program.group_call(g["bufs"], plan, layer)
            b.patch(U, g["handles"][layer], op, args, kwargs, g["events"][layer])
        return out, done

    def lone_steps(self, n: int, first: int = 0) -> tuple[list[float], list[float]]:
        """``n`` steps, each waited for before the next is issued: wall seconds per step
        (from the previous step's output on the host to this one's: a loop's period, as
        the timed model hides the host's Python before an update inside the update)
        and modelled seconds between consecutive ends."""
        wall, ends = [], []
        t0 = time.perf_counter()
        for i in range(n):
            _, done = self.issue(_lengths(first + i))
            done.synchronize()
            t1 = time.perf_counter()
            wall.append(t1 - t0)
            t0 = t1
            ends.append(done)
        return wall, modelled_gaps(ends)

    def windowed(self, n: int, window: int = WINDOW) -> tuple[float, list[float]]:
        """``n`` steps with ``window`` in flight: wall steps/s, modelled seconds between
        consecutive ends."""
        pending: list[Any] = []
        ends = []
        t0 = time.perf_counter()
        for i in range(n):
            if len(pending) >= window:
                pending.pop(0).synchronize()
            _, done = self.issue(_lengths(i))
            pending.append(done)
            ends.append(done)
        for done in pending:
            done.synchronize()
        return n / (time.perf_counter() - t0), modelled_gaps(ends)


def modelled_gaps(ends: list[Any]) -> list[float]:
    """Modelled seconds between consecutive done events (timing events on the timed
    sim: the cost model's device time, which the machine's load does not shorten)."""
    return [a.elapsed_time(b) / 1000 for a, b in itertools.pairwise(ends)]


@dataclass
class InProcessFigures:
    profile: str
    patch_us: float
    task_us: float
    layers: int
    floor_ms: float  # a lone step's
    limit_steps_s: float  # windowed
    inprocess_latency_ms: list[float]  # each run's mean period of a loop waiting per step
    daemon_latency_ms: list[float]
    inprocess_steps_s: list[float]
    daemon_steps_s: list[float]
    inprocess_modelled_latency_ms: float  # the timed model's own figure (no load in it)
    inprocess_modelled_steps_s: float

    @property
    def latency_ratio(self) -> float:
        """Daemon over in-process, lone-step latency (medians over runs)."""
        return statistics.median(self.daemon_latency_ms) / statistics.median(
            self.inprocess_latency_ms
        )

    @property
    def throughput_ratio(self) -> float:
        """Daemon over in-process, windowed steps/s (medians over runs)."""
        return statistics.median(self.daemon_steps_s) / statistics.median(self.inprocess_steps_s)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(latency_ratio=round(self.latency_ratio, 3),
                 throughput_ratio=round(self.throughput_ratio, 3))  # fmt: skip
        return d


async def _daemon_lone(c: Client, n: int) -> list[float]:
    """Wall seconds per step of a client that waits for each step (reply to reply)."""
    period = []
    t0 = time.perf_counter()
    for i in range(n):
        await c.step("attention", 0, {"actual_seq_lengths_kv": _lengths(i)}, outputs=["out"])
        t1 = time.perf_counter()
        period.append(t1 - t0)
        t0 = t1
    return period


async def _daemon_windowed(c: Client, n: int) -> float:
    left = n

    async def caller() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await c.step("attention", 0, {"actual_seq_lengths_kv": _lengths(left)},
                         outputs=["out"])  # fmt: skip

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(WINDOW)))
    return n / (time.perf_counter() - t0)


def measure(
    profile: str, patch_us: float, task_us: float, steps: int = 60, reps: int = 3
) -> InProcessFigures:
    """The in-process loop and a daemon at serve's default config, the same profile,
    measured in alternation ``reps`` times (a slow spell of the machine falls on both)."""
    loop = InProcessLoop(patch_us, task_us)
    daemon = BenchDaemon(PROGRAM, sim={"mode": "timed", "patch_us": patch_us, "task_us": task_us})
    try:
        figures = asyncio.run(_alternate(loop, daemon.endpoint, steps, reps))
    finally:
        daemon.close()
    worst, best = max(patch_us, task_us), min(patch_us, task_us)
    return InProcessFigures(
        profile=profile,
        patch_us=patch_us,
        task_us=task_us,
        layers=LAYERS,
        floor_ms=(LAYERS * worst + best) / 1000,
        limit_steps_s=1e6 / (LAYERS * worst),
        **figures,
    )


async def _alternate(loop: InProcessLoop, endpoint: str, steps: int, reps: int) -> dict[str, Any]:
    # Wall periods are averaged, not their median taken: the timed model hides a stall of
    # the machine (its modelled time falls behind), and the host then runs the next
    # steps' charges without sleeping until the model catches up, so a run's periods
    # are a few long ones and many short ones whose mean is the model's.
    ms: Callable[[list[float]], float] = lambda xs: 1000 * statistics.median(xs)  # noqa: E731
    mean_ms: Callable[[list[float]], float] = lambda xs: 1000 * statistics.fmean(xs)  # noqa: E731
    out: dict[str, list[float]] = {k: [] for k in ("il", "dl", "it", "dt")}
    modelled_lone: list[float] = []
    modelled_gaps: list[float] = []
    async with Client(endpoint, timeout=120) as c:
        await _daemon_windowed(c, 2 * WINDOW)  # warm up both
        loop.windowed(2 * WINDOW)
        for _ in range(reps):
            wall, gaps = loop.lone_steps(steps)
            out["il"].append(mean_ms(wall))
            modelled_lone += gaps
            out["dl"].append(mean_ms(await _daemon_lone(c, steps)))
            rate, gaps = loop.windowed(steps)
            out["it"].append(rate)
            modelled_gaps += gaps[WINDOW:]  # the steady state
            out["dt"].append(await _daemon_windowed(c, steps))
    return {
        "inprocess_latency_ms": out["il"],
        "daemon_latency_ms": out["dl"],
        "inprocess_steps_s": out["it"],
        "daemon_steps_s": out["dt"],
        "inprocess_modelled_latency_ms": ms(modelled_lone),
        "inprocess_modelled_steps_s": 1 / statistics.median(modelled_gaps),
    }


def table(results: list[InProcessFigures]) -> str:
    def rng(xs: list[float], f: str) -> str:
        return f"{min(xs):{f}}-{max(xs):{f}}"

    head = (
        f"{'profile':<9} {'patch/task us':>13} {'floor ms':>8} {'lone ms in-proc':>15} "
        f"{'(modelled)':>10} {'lone ms daemon':>14} {'daemon/in':>9} {'limit/s':>8} "
        f"{'steps/s in-proc':>15} {'(modelled)':>10} {'steps/s daemon':>14} {'daemon/in':>9}"
    )
    lines = [head]
    for r in results:
        lines.append(
            f"{r.profile:<9} {f'{r.patch_us:g}/{r.task_us:g}':>13} {r.floor_ms:8.3f} "
            f"{rng(r.inprocess_latency_ms, '.3f'):>15} {r.inprocess_modelled_latency_ms:10.3f} "
            f"{rng(r.daemon_latency_ms, '.3f'):>14} {r.latency_ratio:8.2f}x "
            f"{r.limit_steps_s:8.0f} {rng(r.inprocess_steps_s, '.0f'):>15} "
            f"{r.inprocess_modelled_steps_s:10.0f} {rng(r.daemon_steps_s, '.0f'):>14} "
            f"{r.throughput_ratio:8.2f}x"
        )
    return "\n".join(lines)


__all__ = ["PROFILES", "InProcessFigures", "InProcessLoop", "measure", "modelled_gaps", "table"]
