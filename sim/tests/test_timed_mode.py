"""Timed mode: replayed tasks cost modelled device time instead of computing.

Timing itself is measured by the benchmarks, never asserted here; these tests
check the mode's semantics and its configuration.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from npusim import SimConfig, configure, torch_npu
from npusim.runtime import CostClock, model_now


@pytest.fixture
def restore_config() -> Iterator[None]:
    old = configure()
    yield
    configure(mode=old.mode, task_us=old.task_us, patch_us=old.patch_us)


def _captured() -> tuple[torch.npu.NPUGraph, torch.Tensor]:  # type: ignore[name-defined]
    q = torch.randn(2, 4, 1, 8, dtype=torch.float16).npu()
    kv = torch.randn(2, 4, 16, 8, dtype=torch.float16).npu()
    out = torch.zeros_like(q)
    lse = torch.zeros(1, device="npu")
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        torch_npu.npu_fused_infer_attention_score.out(
            q, kv, kv, num_heads=4, input_layout="BNSD", out=[out, lse]
        )
    return g, out


def test_timed_replay_charges_time_instead_of_computing(restore_config: None) -> None:
    g, out = _captured()
    configure(mode="timed", task_us=50, patch_us=50)
    g.replay()
    torch.npu.synchronize()
    assert torch.count_nonzero(out.cpu()) == 0  # the task did not compute
    configure(mode="compute")
    g.replay()
    torch.npu.synchronize()
    assert torch.count_nonzero(out.cpu()) > 0


def test_eager_ops_still_compute_in_timed_mode(restore_config: None) -> None:
    configure(mode="timed", task_us=50)
    x = torch.ones(4).npu() * 3
    assert x.sum().item() == 12


@pytest.mark.parametrize(
    "kwargs",
    [{"mode": "fast"}, {"task_us": -1.0}, {"patch_us": -5.0}, {"watchdog_s": 0.0}],
)
def test_invalid_config_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SimConfig(**kwargs)  # type: ignore[arg-type]


def test_tasks_in_a_row_cost_their_sum_before_anything_after_them(restore_config: None) -> None:
    """Tasks in a row sleep once for all of them (CostClock.add, then settle), but what
    follows them (here the replay's end, seen by synchronize) comes no earlier than
    their summed modelled time. A lower bound on elapsed time: the sim must never
    finish modelled work early, however late the machine runs it."""
    x = torch.ones(4).npu()
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        for _ in range(3):
            x.add_(1)
    configure(mode="timed", task_us=20_000)
    torch.npu.synchronize()
    t0 = time.perf_counter()
    g.replay()
    torch.npu.synchronize()
    assert time.perf_counter() - t0 >= 3 * 0.020


def test_a_late_wake_up_does_not_eat_the_slack_window() -> None:
    """Work that follows a charge within SLACK_S of the thread's wake-up from it starts
    at the charge's modelled end: a sleep that woke late is the simulator's delay, not
    the thread's. Work that follows later starts when it started (synthetic times)."""
    slack = CostClock.SLACK_S
    clock = CostClock()
    clock.end, clock.woke = 10.0, 10.0 + 4 * slack  # woke four windows late
    clock.add(1500, started=clock.woke + slack / 2)
    assert clock.end == 10.0 + 1500e-6  # back to back with the previous charge

    clock = CostClock()
    clock.end, clock.woke = 10.0, 10.0  # woke on time
    clock.add(1500, started=10.0 + 4 * slack)  # the thread did something else meanwhile
    assert clock.end == 10.0 + 4 * slack + 1500e-6


def test_event_times_are_modelled_device_time(restore_config: None) -> None:
    """Events on a stream around a replay of timed tasks are as far apart as the tasks'
    modelled device time, exactly: the sleeps' oversleep and the simulator's own Python
    in between are not device time (they are what timed mode hides). The stream is held
    by a wait until everything is issued, so the host's issue times do not show."""
    g, _ = _captured()
    S, other = torch.npu.Stream(), torch.npu.Stream()
    configure(mode="timed", task_us=700, patch_us=0)
    for _ in range(3):
        hold = torch_npu.npu.ExternalEvent()
        hold.wait(S)
        start = torch.npu.Event(enable_timing=True)
        end = torch.npu.Event(enable_timing=True)
        with torch.npu.stream(S):
            start.record(S)
            g.replay()
            g.replay()
            end.record(S)
        hold.record(other)
        end.synchronize()
        # two replays of one task back to back: 2 x 700 us of device time
        assert start.elapsed_time(end) == pytest.approx(1.4, abs=1e-6)


def test_a_thread_that_was_blocked_between_two_charges_does_not_hide_the_wait() -> None:
    """Only what the thread computed is hidden in the window: time it spent blocked (on
    a queue, a socket: waiting for work that had not arrived) between two charges is
    added to the second's start, so no chain of charges runs below its model."""
    slack = CostClock.SLACK_S
    clock = CostClock()
    clock.charge(100)
    end = clock.end
    time.sleep(slack / 2)  # blocked: no CPU time on this thread
    clock.add(100)
    # the sleep (or, if it overslept past the window, the time it started) is in the start
    assert clock.end - end >= 100e-6 + slack / 2 - 100e-6

    clock = CostClock()  # a synthetic wake-up: all of the gap was computed, none blocked
    clock.end, clock.woke, clock.woke_cpu = 10.0, 10.0, time.thread_time() - slack
    clock.add(100, started=10.0 + slack / 2)
    assert clock.end <= 10.0 + 100e-6 + 1e-9


def test_work_after_a_wait_starts_no_earlier_than_the_wait_ended() -> None:
    """A thread that blocked (for a request on a socket, an item on a queue: what the
    simulator cannot see) starts its next charge when it issues it: neither its Python
    before the wait nor its lag behind the device's modelled end is hidden, or a step
    would start before the request that asked for it arrived (a daemon's lone step held
    for less than its floor)."""
    clock = CostClock()
    clock.charge(100)
    clock.end -= 300e-6  # the device's modelled end, which the host noticed late
    time.sleep(CostClock.SLACK_S / 4)  # blocked, within the window
    started = time.perf_counter()
    clock.add(100, started=started)
    assert clock.end >= started + 100e-6 - 1e-9


def test_the_hosts_python_after_it_saw_a_step_end_is_not_hidden(restore_config: None) -> None:
    """A host that saw a replay end and then computed without waiting (a worker that
    replied, found the next request already queued on its socket and planned it) is
    at now in the model, not at the replay's modelled end: that Python is the
    program's, and the request it took may have come after the replay ended. Hiding it
    let a daemon's lone serial step be held 0.67 ms against its 0.98 ms floor."""
    g, _ = _captured()
    configure(mode="timed", task_us=700, patch_us=0)
    g.replay()
    torch.npu.synchronize()  # this thread observes the replay's modelled end
    spun = time.perf_counter() + CostClock.SLACK_S / 2  # inside the window
    while time.perf_counter() < spun:  # computing: no wait the cost model could see
        pass
    assert model_now() >= spun
