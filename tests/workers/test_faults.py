"""The fault injector meets the engine where a device would show the fault, whatever
the order in which the engine issues a step's work."""

from __future__ import annotations

import time

import torch
from npusim import torch_npu

from graphlane.workers.backends.faults import FaultyBackend
from graphlane.workers.backends.npu import NpuBackend


def test_a_hung_device_holds_the_step_whose_releases_came_before_its_replay() -> None:
    """``hang_after=1``: the second replay never runs, although its step's releases were
    recorded before it (the engine hands a step's patches over before its replay). An
    injector that decided the hang at the replay, by dropping later releases only, let
    that step through and hung the step after it instead."""
    b = FaultyBackend(NpuBackend(torch_npu, 0), hang_after=1)
    S, U = b.new_stream(), b.new_stream()
    x = torch.zeros(4, device=b.device)
    graph = b.new_graph()
    with b.use_stream(S), b.capture(graph, S):
        x.add_(1)
    b.replay(graph, S)
    b.synchronize()
    assert x.cpu().tolist() == [1.0] * 4

    release = b.new_external_event()
    b.record(release, U)  # the second step's release, before its replay
    b.replay(graph, S)
    done = b.new_event()
    b.record(done, S)
    deadline = time.monotonic() + 1.0  # a replay of one add is over in microseconds
    while time.monotonic() < deadline and not done.query():
        time.sleep(0.01)
    assert not done.query(), "the step after hang_after replays ran"
    assert b.hanging

    b.inner.record(b.stuck, U)  # the test lets the device go on, to clean up
    b.synchronize()
    assert done.query() and x.cpu().tolist() == [2.0] * 4
