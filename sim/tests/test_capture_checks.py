"""Checks torch_npu 2.14 or CANN make during capture (issue 18, item 5), with their text.

- ``capture_error_mode``: torch_npu's ``_NPUGraph.capture_begin`` binding accepts
  "global", "thread_local" and "relaxed" only;
- ``NPUGraph::capture_end`` on another stream than capture_begin's;
- a task group takes Cube/Vector-core kernels only (CANN EE1006): no event record or
  wait, no host-device copy;
- a ``non_blocking`` copy with pageable host memory makes torch_npu synchronize the
  stream, which a "global" capture forbids on every thread and a "thread_local" one on
  the capturing thread (ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT);
- an ExternalEvent's waited flag is cleared by a record only, not by ``NPUGraph.reset``.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from npusim import SimUsageError, reset_device


def test_unknown_capture_error_mode_is_refused_and_nothing_captures() -> None:
    s = torch.npu.Stream()
    g = torch.npu.NPUGraph()
    with pytest.raises(SimUsageError) as info, torch.npu.graph(
        g, stream=s, capture_error_mode="default"
    ):
        pass
    assert str(info.value) == (
        "Unknown capture error mode. Expected `global`, `thread_local`, or `relaxed`, got default"
    )
    assert not s.is_capturing()
    assert torch.npu.current_stream() is torch.npu.default_stream()  # the context unwound
    with pytest.raises(SimUsageError, match="Unknown capture error mode"):
        g.capture_begin(capture_error_mode="strict")


@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_the_three_capture_error_modes_capture(mode: str) -> None:
    s, g = torch.npu.Stream(), torch.npu.NPUGraph()
    x = torch.ones(2).npu()
    with torch.npu.graph(g, stream=s, capture_error_mode=mode):
        y = x + 1
    g.replay()
    torch.npu.synchronize()
    assert y.cpu().tolist() == [2.0, 2.0]


def test_capture_end_on_another_stream_is_refused_and_the_capture_goes_on() -> None:
    s, other = torch.npu.Stream(), torch.npu.Stream()
    g = torch.npu.NPUGraph()
    x = torch.ones(2).npu()
    with torch.npu.stream(s):
        g.capture_begin()
        y = x * 3
        with torch.npu.stream(other), pytest.raises(
            SimUsageError, match=r"^Capture must end on the same stream it began on\."
        ):
            g.capture_end()
        assert s.is_capturing()
        g.capture_end()
    g.replay()
    torch.npu.synchronize()
    assert y.cpu().tolist() == [3.0, 3.0]


# ------------------------------------------------------------------ task groups
def _in_group(action: Any) -> None:
    s = torch.npu.Stream()
    x = torch.ones(2).npu()
    with torch.npu.graph(torch.npu.NPUGraph(), stream=s):
        torch.npu.graph_task_group_begin(s)
        torch.mul(x, 2)
        try:
            action(s, x)
        finally:
            torch.npu.graph_task_group_end(s)


@pytest.mark.parametrize(
    "action",
    [
        lambda s, x: torch.npu.Event().record(s),
        lambda s, x: s.wait_stream(s),
        lambda s, x: torch.npu.ExternalEvent().record(s),
        lambda s, x: torch.npu.ExternalEvent().wait(s),
        lambda s, x: x.copy_(torch.ones(2), non_blocking=True),
        lambda s, x: torch.zeros(2).copy_(x, non_blocking=True),
    ],
    ids=["event record", "event wait", "external record", "external wait", "h2d", "d2h"],
)
def test_a_task_group_takes_kernels_only(action: Any) -> None:
    with pytest.raises(SimUsageError, match=r"Only tasks running on Cube Core or Vector Core"):
        _in_group(action)


def test_a_device_copy_is_a_kernel_and_fits_in_a_task_group() -> None:
    _in_group(lambda s, x: x.copy_(x * 5))  # aclnnInplaceCopy


def test_an_external_event_wait_refused_in_a_group_leaves_no_waited_flag() -> None:
    ev = torch.npu.ExternalEvent()
    with pytest.raises(SimUsageError):
        _in_group(lambda s, x: ev.wait(s))
    ev.wait(torch.npu.Stream())  # not "A single record ... multiple wait operations"
    ev.record(torch.npu.Stream())
    torch.npu.synchronize()


# ------------------------------------------------------------------ pageable copies
def test_pageable_non_blocking_h2d_copy_in_a_global_capture_is_refused() -> None:
    s, x = torch.npu.Stream(), torch.zeros(3).npu()
    with pytest.raises(SimUsageError, match=r"pageable.*RELAXED mode.*107030"), torch.npu.graph(
        torch.npu.NPUGraph(), stream=s
    ):
        x.copy_(torch.ones(3), non_blocking=True)


@pytest.mark.filterwarnings("ignore:The NPU Graph is empty")  # nothing captured
def test_global_capture_refuses_it_on_every_thread_thread_local_on_its_own() -> None:
    x = torch.zeros(3).npu()
    errors: list[BaseException | None] = []

    def other_thread_copy() -> None:
        try:
            with torch.npu.stream(torch.npu.Stream()):
                x.copy_(torch.ones(3), non_blocking=True)
            errors.append(None)
        except SimUsageError as exc:
            errors.append(exc)

    for mode in ("global", "thread_local"):
        s = torch.npu.Stream()
        with torch.npu.graph(torch.npu.NPUGraph(), stream=s, capture_error_mode=mode):
            t = threading.Thread(target=other_thread_copy)
            t.start()
            t.join()
            if mode == "thread_local":
                with pytest.raises(SimUsageError, match="thread_local"):
                    x.copy_(torch.ones(3), non_blocking=True)
    assert isinstance(errors[0], SimUsageError) and "'global'" in str(errors[0])
    assert errors[1] is None  # thread_local: another thread may
    torch.npu.synchronize()
    assert x.cpu().tolist() == [1.0] * 3


def test_relaxed_capture_records_the_pageable_copy_and_nothing_is_refused_after() -> None:
    s, g = torch.npu.Stream(), torch.npu.NPUGraph()
    x, host = torch.zeros(3).npu(), torch.ones(3)
    with torch.npu.graph(g, stream=s, capture_error_mode="relaxed"):
        x.copy_(host, non_blocking=True)
    x.copy_(torch.full((3,), 7.0), non_blocking=True)  # no capture underway any more
    torch.npu.synchronize()
    assert x.cpu().tolist() == [7.0] * 3
    host.fill_(4)
    g.replay()
    torch.npu.synchronize()
    assert x.cpu().tolist() == [4.0] * 3


# ------------------------------------------------------------------ ExternalEvent after reset
def _capture_wait(ev: Any) -> Any:
    s, g = torch.npu.Stream(), torch.npu.NPUGraph()
    x = torch.ones(2).npu()
    with torch.npu.graph(g, stream=s):
        ev.wait(s)
        x.add_(1)
    return g


def test_recapturing_a_wait_after_reset_without_a_record_is_refused() -> None:
    ev = torch.npu.ExternalEvent()
    g = _capture_wait(ev)
    g.reset()
    with pytest.raises(
        SimUsageError,
        match=r"^External event: A single record operation cannot be associated with "
        "multiple wait operations",
    ):
        _capture_wait(ev)


def test_a_record_between_lets_the_wait_be_captured_again() -> None:
    ev = torch.npu.ExternalEvent()
    g = _capture_wait(ev)
    g.reset()
    ev.record(torch.npu.Stream())  # clears the waited flag (and sets the event)
    g2 = _capture_wait(ev)
    g2.replay()  # consumes that record
    torch.npu.synchronize()


def test_a_device_reset_ends_the_capture() -> None:
    s, g = torch.npu.Stream(), torch.npu.NPUGraph()
    x = torch.zeros(2).npu()
    with torch.npu.stream(s):
        g.capture_begin(capture_error_mode="global")
        reset_device()
        with pytest.raises(SimUsageError, match="not capturing"):
            g.capture_end()
    x.copy_(torch.ones(2), non_blocking=True)  # no global capture is underway any more
    torch.npu.synchronize()
    assert x.cpu().tolist() == [1.0, 1.0]


def test_to_cpu_non_blocking_in_a_global_capture_is_fine_torch_pins_its_output() -> None:
    s, g = torch.npu.Stream(), torch.npu.NPUGraph()
    x = torch.full((2,), 3.0).npu()
    with torch.npu.graph(g, stream=s):
        y = x * 2
        host = y.to("cpu", non_blocking=True)
        host64 = y.to("cpu", torch.float64, non_blocking=True)
        with pytest.raises(SimUsageError, match="pageable"):
            torch.zeros(2).copy_(y, non_blocking=True)  # the caller's pageable memory
    g.replay()
    torch.npu.synchronize()
    assert host.tolist() == [6.0, 6.0] and host64.tolist() == [6.0, 6.0]
