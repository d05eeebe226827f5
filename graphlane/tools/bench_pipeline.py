"""Pipelining measured on the timed sim, side by side in one run.

For each cost profile (per-layer host update time ``patch_us`` and device
replay time ``task_us``) the same engine configuration runs serial steps,
pipelined steps, and single steps one at a time, and the figures are reported
as ratios to the physical limits:

- throughput limit: 1 / (layers * max(patch_us, task_us))
- latency floor:    layers * max(patch_us, task_us) + min(patch_us, task_us)

Serial and pipelined engines run in alternation, a few repetitions each, and
the medians are reported (latency: the median of single steps).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from graphlane.sim import SimConfig, configure
from graphlane.workers.backends.sim import SimBackend
from graphlane.workers.engine import StepEngine, StepRequest
from graphlane.workers.programs import AttentionConfig, AttentionProgram

PROFILES: dict[str, tuple[float, float]] = {
    # name: (patch_us, task_us); the 910B3 field figures are ~185 us per layer of
    # update against ~60 us of replay (DESIGN.md), scaled here so that the sim's
    # own Python overhead stays inside the modelled costs.
    "update-bound": (1800.0, 600.0),
    "balanced": (1500.0, 1500.0),
    "replay-bound": (600.0, 1800.0),
}


@dataclass
class PipelineFigures:
    profile: str
    patch_us: float
    task_us: float
    layers: int
    limit_steps_s: float
    serial_steps_s: float
    pipelined_steps_s: float
    floor_ms: float
    latency_ms: float

    @property
    def pipelined_vs_limit(self) -> float:
        return self.pipelined_steps_s / self.limit_steps_s

    @property
    def pipelined_vs_serial(self) -> float:
        return self.pipelined_steps_s / self.serial_steps_s

    @property
    def latency_vs_floor(self) -> float:
        return self.latency_ms / self.floor_ms

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            pipelined_vs_limit=round(self.pipelined_vs_limit, 3),
            pipelined_vs_serial=round(self.pipelined_vs_serial, 3),
            latency_vs_floor=round(self.latency_vs_floor, 3),
        )
        return d


def _requests(n: int, batch: int, max_kv: int) -> list[StepRequest]:
    # Lengths change every step, so every layer is patched every step.
    return [
        StepRequest("attention", batch, {"actual_seq_lengths_kv": [1 + (i % max_kv)] * batch})
        for i in range(n)
    ]


def _throughput(engine: StepEngine, reqs: list[StepRequest]) -> float:
    t0 = time.perf_counter()
    futs = [engine.submit(r) for r in reqs]
    for f in futs:
        f.result(120)
    return len(reqs) / (time.perf_counter() - t0)


def _latency_ms(engine: StepEngine, reqs: list[StepRequest]) -> float:
    """Median time of one step submitted alone (nothing else in flight)."""
    times = []
    for r in reqs:
        t0 = time.perf_counter()
        engine.run(r, 120)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def measure(
    profile: str, patch_us: float, task_us: float, layers: int = 8, steps: int = 40, reps: int = 3
) -> PipelineFigures:
    """Serial and pipelined engines measured in alternation, ``reps`` times; medians."""
    configure(mode="timed", patch_us=patch_us, task_us=task_us)
    cfg = AttentionConfig(layers=layers, num_heads=4, num_kv_heads=2, head_dim=16,
                          max_kv_len=64, buckets=(4,))  # fmt: skip
    backend = SimBackend(0)
    samples: dict[str, list[float]] = {"serial": [], "pipelined": [], "latency": []}
    with (
        StepEngine(backend, [AttentionProgram(cfg)], depth=2, pipeline=False) as serial,
        StepEngine(backend, [AttentionProgram(cfg)], depth=2, pipeline=True) as pipelined,
    ):
        for eng in (serial, pipelined):
            _throughput(eng, _requests(4, 4, cfg.max_kv_len))  # warm up
        for _ in range(reps):
            samples["serial"].append(_throughput(serial, _requests(steps, 4, cfg.max_kv_len)))
            samples["pipelined"].append(_throughput(pipelined, _requests(steps, 4, cfg.max_kv_len)))
            samples["latency"].append(
                _latency_ms(pipelined, _requests(steps // 2, 4, cfg.max_kv_len))
            )
    figures = {k: statistics.median(v) for k, v in samples.items()}
    worst, best = max(patch_us, task_us), min(patch_us, task_us)
    return PipelineFigures(
        profile=profile,
        patch_us=patch_us,
        task_us=task_us,
        layers=layers,
        limit_steps_s=1e6 / (layers * worst),
        serial_steps_s=figures["serial"],
        pipelined_steps_s=figures["pipelined"],
        floor_ms=(layers * worst + best) / 1000,
        latency_ms=figures["latency"],
    )


def run(layers: int = 8, steps: int = 40) -> list[PipelineFigures]:
    old = configure()
    try:
        return [measure(name, p, t, layers, steps) for name, (p, t) in PROFILES.items()]
    finally:
        configure(mode=old.mode, patch_us=old.patch_us, task_us=old.task_us)


def table(results: list[PipelineFigures]) -> str:
    head = (
        f"{'profile':<13} {'patch/task us':>13} {'limit/s':>8} {'serial/s':>9} "
        f"{'pipelined/s':>11} {'vs limit':>8} {'vs serial':>9} {'latency ms':>10} "
        f"{'floor ms':>8} {'vs floor':>8}"
    )
    lines = [head]
    for r in results:
        lines.append(
            f"{r.profile:<13} {f'{r.patch_us:g}/{r.task_us:g}':>13} {r.limit_steps_s:8.1f} "
            f"{r.serial_steps_s:9.1f} {r.pipelined_steps_s:11.1f} {r.pipelined_vs_limit:8.2f} "
            f"{r.pipelined_vs_serial:8.2f}x {r.latency_ms:10.2f} {r.floor_ms:8.2f} "
            f"{r.latency_vs_floor:7.2f}x"
        )
    return "\n".join(lines)


__all__ = ["PROFILES", "PipelineFigures", "SimConfig", "measure", "run", "table"]
