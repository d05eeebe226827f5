"""The timed sim never runs a schedule below its floor (issue 32, item 6).

Each profile drives the 4-layer attention program on the timed sim and reads the
*modelled* device time of each step's end (its done event's time: the cost model's
own clock, which the machine's load only ever makes later), never wall time:

- the field's loop in one process (:class:`~graphlane.bench.inprocess.InProcessLoop`:
  replay, then each layer's update releasing its event), waiting for each step, and
  with a window of steps in flight;
- the step engine as the worker drives it: serial (patches, replay, a host barrier),
  one step at a time with the next issued by another thread when the completion
  thread hands the step back (a daemon's lone step, whose reply and next request
  the simulator cannot see), and a window of steps in flight.

Floors for L layers of per-layer update u (host) and replay c (device):
a step waited for      L * max(u, c) + min(u, c)   (replay first, per-layer events)
the serial engine      L * u + L * c                (patches, then the replay)
steps in flight        L * max(u, c) per step       (one update thread, one replay stream)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from npusim import configure, torch_npu

from graphlane.bench.inprocess import BATCH, LAYERS, PROGRAM, InProcessLoop, modelled_gaps
from graphlane.workers.backends.sim import SimBackend
from graphlane.workers.engine import StepEngine
from graphlane.workers.job import Job, JobKind
from graphlane.workers.programs import AttentionConfig, AttentionProgram, StepPlan

COSTS = [(185.0, 60.0), (60.0, 185.0), (740.0, 240.0), (1000.0, 1000.0)]  # (u, c) per layer
EPS = 1e-9  # modelled times are sums of the costs: exact but for float rounding


@pytest.fixture(autouse=True)
def restore_config() -> Iterator[None]:
    old = configure()
    yield
    configure(mode=old.mode, task_us=old.task_us, patch_us=old.patch_us)


def _lone_floor(u: float, c: float) -> float:
    return (LAYERS * max(u, c) + min(u, c)) * 1e-6


def _assert_window(gaps: list[float], u: float, c: float) -> None:
    """Steps in flight: over the run, at least the limit per step (the first step's
    own fill of the pipeline may overlap the next one's, never more than one step)."""
    limit = LAYERS * max(u, c) * 1e-6
    assert sum(gaps) >= len(gaps) * limit - _lone_floor(u, c) - EPS, (gaps, limit)


@pytest.mark.parametrize(("u", "c"), COSTS)
def test_the_in_process_loop_never_beats_its_floor(u: float, c: float) -> None:
    loop = InProcessLoop(u, c)
    _, gaps = loop.lone_steps(12)
    assert min(gaps) >= _lone_floor(u, c) - EPS, (gaps, _lone_floor(u, c))
    _, gaps = loop.windowed(16, window=4)
    _assert_window(gaps, u, c)


class _TimedEvents(SimBackend):
    """The sim backend with timing events, so a step's done event tells its modelled end."""

    def new_event(self) -> Any:
        return torch_npu.npu.Event(enable_timing=True)


def _engine(pipeline: bool, on_done: Any) -> StepEngine:
    cfg = {k: v for k, v in PROGRAM.items() if k != "buckets"}
    program = AttentionProgram(AttentionConfig(buckets=(BATCH,), **cfg))  # type: ignore[arg-type]
    return StepEngine(_TimedEvents(), [program], on_done=on_done, depth=2,
                      pipeline=pipeline, max_inflight=8 if pipeline else 1)  # fmt: skip


def _step(engine: StepEngine, i: int) -> Job:
    lengths = (1 + i % 8,) * BATCH
    return Job(JobKind.STEP, StepPlan("attention", BATCH, BATCH, {"lengths": lengths}), ("out",))


@pytest.mark.parametrize(("u", "c"), COSTS)
@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "serial"])
def test_lone_engine_steps_never_beat_their_floor(pipeline: bool, u: float, c: float) -> None:
    """One step at a time; the next is issued by this thread as soon as the engine hands
    the step back (from its completion thread, as a daemon's reply and next request)."""
    answered = threading.Event()
    steps: list[Job] = []

    def on_done(step: Job) -> None:
        steps.append(step)
        answered.set()

    with _engine(pipeline, on_done) as engine:
        configure(mode="timed", patch_us=u, task_us=c)
        for i in range(12):
            answered.clear()
            assert engine.reserve()
            engine.issue(_step(engine, i))
            assert answered.wait(60)
    assert all(s.error is None for s in steps)
    floor = _lone_floor(u, c) if pipeline else LAYERS * (u + c) * 1e-6
    gaps = modelled_gaps([s.done for s in steps])
    assert min(gaps) >= floor - EPS, (gaps, floor)


@pytest.mark.parametrize(("u", "c"), COSTS)
def test_engine_steps_in_flight_never_beat_their_floor(u: float, c: float) -> None:
    steps: list[Job] = []
    with _engine(True, steps.append) as engine:
        configure(mode="timed", patch_us=u, task_us=c)
        issued = []
        for i in range(16):
            assert engine.reserve()  # blocks while 8 are in flight
            issued.append(_step(engine, i))
            engine.issue(issued[-1])
        for s in issued:
            s.done.synchronize()
    assert all(s.error is None for s in issued)
    _assert_window(modelled_gaps([s.done for s in issued]), u, c)
