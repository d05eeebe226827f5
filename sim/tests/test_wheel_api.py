"""The sim follows torch_npu 2.14 where graphlane's npu provider goes (issue 29, item 6):
``Stream(stream_id=, device_index=, device_type=, priority=)``,
``torch.npu.stream(stream=...)``, a ``reset`` inside a task group refused,
``NPUGraph.pool()`` before a capture refused, ``pin_memory()``, and the ``legacy``
event mode of older CANN, where a captured wait leaves the flag set until ``reset``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from npusim import HazardError, SimUsageError, configure
from test_host_ordering import Stack, lengths_for


@pytest.fixture
def legacy() -> Iterator[None]:
    old = configure()
    configure(event_mode="legacy", watchdog_s=600)
    yield
    configure(event_mode=old.event_mode, watchdog_s=old.watchdog_s)


def test_stream_named_by_its_ids_is_that_stream() -> None:
    s = torch.npu.Stream(priority=-1)
    assert s.priority == -1
    named = torch.npu.Stream(
        stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type
    )
    assert named is s and named.priority == -1
    default = torch.npu.Stream(stream_id=0, device_index=0, device_type=s.device_type)
    assert default is torch.npu.default_stream(0)
    with pytest.raises(TypeError):
        torch.npu.Stream(stream=s)  # not a keyword of _NPUStreamBase
    with pytest.raises(SimUsageError):
        torch.npu.Stream(stream_id=10**6, device_index=0, device_type=s.device_type)


def test_stream_context_takes_the_wheels_keyword() -> None:
    s = torch.npu.Stream()
    with torch.npu.stream(stream=s):
        assert torch.npu.current_stream() is s
    assert torch.npu.current_stream() is not s


def test_reset_inside_a_task_group_is_refused() -> None:
    s = torch.npu.Stream()
    ev = torch.npu.ExternalEvent()
    g = torch.npu.NPUGraph()
    x = torch.zeros(4, device="npu")
    with pytest.raises(SimUsageError, match="task group"), torch.npu.graph(g, stream=s):
        ev.wait(s)
        torch.npu.graph_task_group_begin(s)
        x.add_(1)
        ev.reset(s)


def test_pool_before_any_capture_is_refused() -> None:
    g = torch.npu.NPUGraph()
    with pytest.raises(SimUsageError, match="pool"):
        g.pool()


def test_pinned_host_memory_may_be_copied_inside_a_capture() -> None:
    host = torch.ones(8)
    pinned = host.pin_memory()
    assert pinned.is_pinned() and not host.is_pinned()
    s = torch.npu.Stream()
    dst = torch.zeros(8, device="npu")
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, stream=s):
        dst.copy_(pinned, non_blocking=True)
    g.replay()
    torch.npu.synchronize()
    assert torch.equal(dst.cpu(), host)


def test_legacy_cann_with_reset_after_each_captured_wait_runs_clean(legacy: None) -> None:
    stack = Stack(41, reset=True)
    for step in range(4):
        lengths = lengths_for(step)
        stack.patch_all(lengths)
        stack.replay()
        stack.check(lengths)


def test_legacy_cann_without_reset_is_reported(legacy: None) -> None:
    """Older CANN leaves the flag set after the captured wait: the next release finds it
    set (lost), and the next replay passes the wait on the stale flag, unordered with the
    patch behind it (a race). Which of the two the sim sees first depends on how the
    streams interleave; either is reported, when the device reaches it. The replay may
    have read the old parameters before that (as on the device, where nothing reports
    it), so the device is synchronized before the numbers are looked at."""
    stack = Stack(42)
    with pytest.raises(HazardError, match=r"lost|race"):
        for step in range(3):
            lengths = lengths_for(step)
            stack.patch_all(lengths)
            stack.replay()
            torch.npu.synchronize()
            stack.check(lengths)


def test_current_cann_runs_without_reset() -> None:
    assert configure().event_mode == "cann"
    stack = Stack(43)
    for step in range(3):
        lengths = lengths_for(step)
        stack.patch_all(lengths)
        stack.replay()
        stack.check(lengths)
