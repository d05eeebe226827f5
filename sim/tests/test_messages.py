"""What the sim's reports name, whichever way a run's timing falls."""

from __future__ import annotations

import pytest
import torch
from npusim import HazardError, configure, torch_npu  # noqa: F401  (sets the device up)


def test_lost_release_names_the_graph_that_waits_on_the_event(watchdog_off: None) -> None:
    """Two records before the replay that consumes the first: the report names the
    graph and the task group the event releases, not only the event."""
    s, u = torch.npu.Stream(), torch.npu.Stream()
    ev = torch.npu.ExternalEvent()
    x = torch.zeros(2, device="npu")
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, stream=s):
        ev.wait(s)
        torch.npu.graph_task_group_begin(s)
        x.add_(1)
        torch.npu.graph_task_group_end(s)
    ev.record(u)
    ev.record(u)  # nothing consumed the first one: the two merge
    with pytest.raises(HazardError) as info:
        torch.npu.synchronize()
    assert info.value.kind == "lost-release"
    assert g.name in str(info.value) and "task group 0" in str(info.value)
    assert ev.name in str(info.value)


def test_race_names_the_replay_and_the_patch_either_way_round() -> None:
    s, u = torch.npu.Stream(), torch.npu.Stream()
    x = torch.zeros(2, device="npu")
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, stream=s):
        torch.npu.graph_task_group_begin(s)
        x.add_(1)
        handle = torch.npu.graph_task_group_end(s)
    with torch.npu.stream(s):
        g.replay()
    with torch.npu.stream(u):  # not ordered after the replay that reads the group
        torch.npu.graph_task_update_begin(u, handle)
        x.add_(1)
        torch.npu.graph_task_update_end(u)
    with pytest.raises(HazardError) as info:
        torch.npu.synchronize()
    text = str(info.value)
    assert f"replay #1 of {g.name} on stream {s.stream_id}" in text
    assert f"the patch of add_.Tensor on stream {u.stream_id}" in text
